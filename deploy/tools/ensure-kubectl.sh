#!/bin/sh
# Make sure `kubectl` is on PATH: tests/deploy renders the manifests with
# `kubectl kustomize`. Installs Debian's kubernetes-client when it is missing.
set -eu

if command -v kubectl >/dev/null 2>&1; then
    exit 0
fi
install="apt-get update && apt-get install -y kubernetes-client"
if [ "$(id -u)" -ne 0 ]; then
    echo "kubectl is missing; the deploy tests need it. As root, run: $install" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "kubectl is missing and there is no apt-get: install kubectl (>= 1.14) yourself" >&2
    exit 1
fi
echo "kubectl is missing: $install" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kubernetes-client >/dev/null
command -v kubectl >/dev/null 2>&1
