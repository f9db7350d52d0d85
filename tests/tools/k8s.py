"""Manifest helpers for tests/deploy.rs.

  k8s.py json FILE       the YAML stream in FILE as one JSON list of objects
  k8s.py validate FILE   validates every object offline against the Kubernetes schemas
                         (kubernetes-validate, strict: unknown fields are errors); prints one
                         line per object and exits 1 if any is invalid
"""
import json
import sys

import yaml


def load(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def validate(path, version="1.31.0"):
    import kubernetes_validate

    bad = 0
    for doc in load(path):
        name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
            print(f"valid {name}")
        except kubernetes_validate.ValidationError as e:
            bad += 1
            print(f"INVALID {name}: {e.message} at {list(e.path)}")
        except kubernetes_validate.SchemaNotFoundError as e:
            bad += 1
            print(f"NO SCHEMA {name}: {e}")
    return 1 if bad else 0


if __name__ == "__main__":
    cmd, path = sys.argv[1], sys.argv[2]
    if cmd == "json":
        json.dump(load(path), sys.stdout)
    elif cmd == "validate":
        sys.exit(validate(path))
    else:
        sys.exit(f"unknown command {cmd}")
