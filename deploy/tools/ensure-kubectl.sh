#!/bin/sh
# Make sure a `kubectl` that can render deploy/k8s is on PATH: tests/deploy renders the
# manifests with `kubectl kustomize`. The manifests use `resources:` directories and
# `patches:`, so they need kustomize v4 or later: kubectl 1.21 or later.
# Installs Debian's kubernetes-client when kubectl is missing, and checks its version.
set -eu

MIN_MINOR=21

minor() {
    # "minor": "32" or "32+" in `kubectl version --client -o json`.
    kubectl version --client -o json 2>/dev/null \
        | sed -n 's/.*"minor": *"\([0-9]*\).*/\1/p' | head -n 1
}

check() {
    found=$(minor)
    if [ -z "$found" ] || [ "$found" -lt "$MIN_MINOR" ]; then
        echo "kubectl 1.${found:-?} is too old for deploy/k8s (kustomize v4 needs 1.$MIN_MINOR or later)." >&2
        echo "Install a newer kubectl (https://kubernetes.io/docs/tasks/tools/), or point" >&2
        echo "PDXFER_KUBECTL at one." >&2
        exit 1
    fi
}

if command -v kubectl >/dev/null 2>&1; then
    check
    exit 0
fi
install="apt-get update && apt-get install -y kubernetes-client"
if [ "$(id -u)" -ne 0 ]; then
    echo "kubectl is missing; the deploy tests need it (1.$MIN_MINOR or later). As root, run: $install" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "kubectl is missing and there is no apt-get: install kubectl (1.$MIN_MINOR or later) yourself" >&2
    exit 1
fi
echo "kubectl is missing: $install" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kubernetes-client >/dev/null
command -v kubectl >/dev/null 2>&1
check
