#!/usr/bin/env bash
# foreign-rootfs.sh ROOT -- mmdebstrap --extract-hook for scripts/ci-setup.sh's
# arm64 base images.
#
# Why: a Debian root of another architecture made the usual way runs every
# package's maintainer scripts under QEMU (mmdebstrap 332 s, debootstrap's
# second stage 454 s on 2 cores). The `extract` variant only unpacks the
# packages (about 15 s); this hook then does, on the host, the few things their
# scripts would have done that the test images need, and runs the handful of
# foreign binaries that must run (each one QEMU start, a fraction of a second):
#
#   * dpkg's database: every unpacked package recorded as installed, with its
#     file list, so apt inside the image (the compiler layer) resolves against
#     what is there instead of reinstalling libc;
#   * the accounts (base-passwd's masters, then pwconv/grpconv), for useradd;
#   * the CA bundle (ca-certificates' conf, update-ca-certificates), for pip;
#   * the dynamic linker's cache (ldconfig) and the awk alternative (mawk).
#
# What it cannot give: the other maintainer scripts never ran (no systemd
# units, no generated locales beyond glibc's built-in C.UTF-8, no debconf
# answers). That is enough for a stand-in of python:3.11-slim-bookworm and
# debian:bookworm-slim, not for a general-purpose Debian.
set -euo pipefail

root="${1:?usage: foreign-rootfs.sh ROOT}"
[[ -d "$root/var/lib/dpkg" ]] || { echo "foreign-rootfs: $root has no var/lib/dpkg" >&2; exit 1; }

record_packages() {
    local deb pkg arch
    local status="$root/var/lib/dpkg/status" info="$root/var/lib/dpkg/info"
    mkdir -p "$info"
    for deb in "$root"/var/cache/apt/archives/*.deb; do
        [[ -e "$deb" ]] || continue
        pkg="$(dpkg-deb -f "$deb" Package)"
        arch="$(dpkg-deb -f "$deb" Architecture)"
        # Package first, then Status, then the rest of the control stanza.
        {
            echo "Package: $pkg"
            echo "Status: install ok installed"
            dpkg-deb -f "$deb" | grep -v '^Package:'
            echo
        } >>"$status"
        local list="$info/$pkg.list"
        [[ "$arch" == all ]] || list="$info/$pkg:$arch.list"
        dpkg-deb --fsys-tarfile "$deb" | tar -t | sed -e 's|^\./|/|' -e 's|^\.$|/.|' -e 's|/$||' >"$list"
    done
}

make_accounts() {
    cp "$root/usr/share/base-passwd/passwd.master" "$root/etc/passwd"
    cp "$root/usr/share/base-passwd/group.master" "$root/etc/group"
    chroot "$root" /usr/sbin/pwconv
    chroot "$root" /usr/sbin/grpconv
}

make_ca_bundle() {
    [[ -d "$root/usr/share/ca-certificates" ]] || return 0
    (cd "$root/usr/share/ca-certificates" && find . -name '*.crt' -printf '%P\n' | LC_ALL=C sort) \
        >"$root/etc/ca-certificates.conf"
    chroot "$root" /usr/sbin/update-ca-certificates >/dev/null
}

record_packages
make_accounts
make_ca_bundle
chroot "$root" /sbin/ldconfig
[[ -e "$root/usr/bin/mawk" && ! -e "$root/usr/bin/awk" ]] && ln -s mawk "$root/usr/bin/awk"
# The mirror over plain HTTP, as the amd64 bases have it (containers do not
# trust the TLS-intercepting proxy's CA).
echo "deb http://deb.debian.org/debian bookworm main" >"$root/etc/apt/sources.list"
exit 0
