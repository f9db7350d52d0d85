"""Fetches a /metrics URL and parses it with prometheus_client's own text parser (so a format
error fails here). Prints {"name{label=value,...}": value, ...} as JSON; exits 1 if the
exposition does not parse."""
import json
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

url = sys.argv[1]
with urllib.request.urlopen(url, timeout=10) as r:
    ctype = r.headers.get("Content-Type", "")
    text = r.read().decode()
if not ctype.startswith("text/plain"):
    sys.exit(f"content type {ctype!r} is not the Prometheus text format")
out = {}
for family in text_string_to_metric_families(text):
    if not family.documentation:
        sys.exit(f"{family.name} has no HELP")
    for s in family.samples:
        labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
        out[f"{s.name}{{{labels}}}"] = s.value
json.dump(out, sys.stdout)
