#!/bin/sh
# Makes what the manifests mount, for a trial (use cert-manager in production:
# certificate.yaml): a CA, one certificate for every coordinator and worker of NAMESPACE, and
# tokens. Writes them to DIR (default ./baton-secrets), then prints the kubectl commands that
# turn them into the Secrets baton-tls and baton-tokens.
#   deploy/kubernetes/examples/make-secrets.sh default ./baton-secrets
set -eu
ns=${1:?usage: make-secrets.sh NAMESPACE [DIR]}
dir=${2:-./baton-secrets}
mkdir -p "$dir"
umask 077
cd "$dir"

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 365 \
  -subj "/CN=baton-ca" -keyout ca.key -out ca.crt 2>/dev/null
# Coordinators are <pod>.baton.<ns>.svc, workers <pod>.baton-worker.<ns>.svc, clients use
# baton-api; localhost and 127.0.0.1 serve `kubectl exec` and port-forwards.
san="DNS:*.baton.$ns.svc,DNS:*.baton-worker.$ns.svc,DNS:baton-api,DNS:baton-api.$ns.svc,DNS:localhost,IP:127.0.0.1"
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -subj "/CN=baton" -keyout tls.key -out tls.csr 2>/dev/null
printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$san" > tls.ext
openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 90 \
  -extfile tls.ext -out tls.crt 2>/dev/null
rm -f tls.csr tls.ext ca.srl

# One token per role for people and CI, and the coordinators' own (admin) token for the
# workers' port. The tokens file keeps only their SHA-256: it is mounted where jobs run (the
# workers), and a digest is no token.
token() { openssl rand -hex 32; }
digest() { tr -d '\n' < "$1" | openssl dgst -sha256 -r | cut -d' ' -f1; }
for role in read submit admin; do token > "$role.token"; done
token > peer-token
{
  echo "# sha256:<digest of the token> role name"
  echo "sha256:$(digest read.token) read viewer"
  echo "sha256:$(digest submit.token) submit ci"
  echo "sha256:$(digest admin.token) admin ops"
  echo "sha256:$(digest peer-token) admin coordinators"
} > tokens

cat <<MSG
Wrote $dir: ca.crt ca.key tls.crt tls.key tokens peer-token read.token submit.token admin.token
Create the Secrets (namespace $ns):
  kubectl -n $ns create secret generic baton-tls --from-file=$dir/tls.crt --from-file=$dir/tls.key --from-file=$dir/ca.crt
  kubectl -n $ns create secret generic baton-tokens --from-file=$dir/tokens --from-file=$dir/peer-token
MSG
