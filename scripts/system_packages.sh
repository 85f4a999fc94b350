#!/usr/bin/env bash
# Installs the operating-system packages the tests, the demo and the local stack need, when missing:
#   fuse        fuse3, libfuse3-3   (the emulator's Cloud Storage FUSE volume; without it: plain folders)
#   deployment  postgresql, chromium, chromium-driver   (tests/deployment: a real Airflow stack and its UI)
# Usage: scripts/system_packages.sh [fuse] [deployment]   (no argument: all groups)
# Needs root and apt-get (Debian/Ubuntu); elsewhere it prints what is missing and exits 0, so a
# laptop without root keeps working (the emulator then says it falls back to folders).
set -euo pipefail
groups=("$@")
[[ ${#groups[@]} -eq 0 ]] && groups=(fuse deployment)
missing=()
for group in "${groups[@]}"; do
    case "$group" in
        fuse)
            command -v fusermount3 >/dev/null || missing+=(fuse3)
            ldconfig -p 2>/dev/null | grep -q 'libfuse3\.so' || missing+=(libfuse3-3)
            ;;
        deployment)
            compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || missing+=(postgresql)
            command -v chromium >/dev/null || missing+=(chromium)
            command -v chromedriver >/dev/null || missing+=(chromium-driver)
            ;;
        *)
            echo "system_packages.sh: unknown group '$group' (allowed: fuse, deployment)" >&2
            exit 2
            ;;
    esac
done
[[ ${#missing[@]} -eq 0 ]] && exit 0
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
    echo "system_packages.sh: missing ${missing[*]}; install them as root (apt-get install ${missing[*]})" >&2
    exit 0
fi
echo "system_packages.sh: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# Another package manager (unattended-upgrades, a second install) may hold apt's locks: wait for
# them up to APT_LOCK_TIMEOUT seconds (default 600) instead of failing at once (apt's
# DPkg::Lock::Timeout option, apt 1.9.11 or newer).
lock_timeout=${APT_LOCK_TIMEOUT:-600}
if ! [[ $lock_timeout =~ ^[0-9]+$ ]]; then
    echo "system_packages.sh: APT_LOCK_TIMEOUT=$lock_timeout: use a whole number of seconds" >&2
    exit 2
fi
apt=(apt-get -q -o "DPkg::Lock::Timeout=$lock_timeout")
"${apt[@]}" install -y --no-install-recommends "${missing[@]}" >/dev/null || {
    "${apt[@]}" update >/dev/null
    "${apt[@]}" install -y --no-install-recommends "${missing[@]}" >/dev/null
}
