#!/usr/bin/env bash
# ci-setup.sh -- bring a fresh CI machine (Debian 12, root, no public Docker
# registry reachable; only Debian's mirror and PyPI) to the state the
# imagefactory test suite needs:
#
#   * two running Docker engines, no default bridge (scripts/ci-engines.sh): the current
#     one on the default socket (Debian 13's docker.io 26.x with the containerd image store,
#     what Docker 29's fresh installs use) and the legacy one on its own socket (Debian 12's
#     docker.io 20.10, overlay2), for the module that keeps the old store supported;
#   * two base images made with debootstrap, standing in for Docker Hub's
#       127.0.0.1:5000/library/debian:bookworm-slim
#       127.0.0.1:5000/library/python:3.11-slim-bookworm
#     each served by the base registry as a two-arch list (linux/amd64 and
#     linux/arm64, as Docker Hub serves them), each platform also under its
#     own tag (IMAGE-amd64, IMAGE-arm64); the engine's local IMAGE is the list
#     as pulled on this host (in the graph-driver store its amd64 image);
#   * QEMU user emulation registered with binfmt_misc (qemu-aarch64), so the
#     engine runs and BuildKit builds linux/arm64 images on this x86_64 host;
#   * podman serving the Docker API on a socket of its own (scripts/ci-engines.sh);
#   * cosign 2.x (/usr/local/bin/cosign) for the signing tests;
#   * the base registry (CNCF distribution 2.8) on 127.0.0.1:5000, no auth, holding the
#     base images ("base_registry" mirror);
#   * Docker Compose v2 (the `docker compose` plugin, Debian 13's), with which the test
#     session itself starts its test services (tests/services/compose.yaml, through
#     pytest-docker): the authenticated registry on 127.0.0.1:5001 (imagefactory /
#     ci-password) and the protected package index. A host registry an earlier setup left
#     on 5001, or a test session's services a killed run left, are stopped here.
#
# Idempotent: every step checks whether its result is already there, and the
# slow part (debootstrap) is cached as tarballs in
# ${IMAGEFACTORY_CI_CACHE:-$HOME/.cache/imagefactory-ci}, so a rerun takes
# seconds. Must run as root; works from any cwd. Exports nothing, but writes
# ${cache}/env.sh with the variables the tests read.
set -euo pipefail

readonly CACHE_DIR="${IMAGEFACTORY_CI_CACHE:-$HOME/.cache/imagefactory-ci}"
readonly MIRROR="http://deb.debian.org/debian"
readonly SUITE="bookworm"
readonly BASE_REGISTRY="127.0.0.1:5000"
readonly TEST_REGISTRY="127.0.0.1:5001"
readonly TEST_USER="imagefactory"
readonly TEST_PASSWORD="ci-password"
readonly DEBIAN_IMAGE="${BASE_REGISTRY}/library/debian:bookworm-slim"
readonly PYTHON_IMAGE="${BASE_REGISTRY}/library/python:3.11-slim-bookworm"
readonly IMAGE_PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Scratch space removed on exit (debootstrap trees, a temporary policy-rc.d).
CLEANUP_PATHS=()
cleanup() {
    local p
    for p in "${CLEANUP_PATHS[@]+"${CLEANUP_PATHS[@]}"}"; do
        remove_tree "$p"
    done
}

# remove_tree DIR: rm -rf, after unmounting what an interrupted debootstrap
# may have left mounted inside (proc, sys), deepest first.
remove_tree() {
    local dir="$1" mnt
    [[ -e "$dir" ]] || return 0
    awk -v d="$dir/" 'index($2, d) == 1 { print $2 }' /proc/mounts | sort -r |
        while read -r mnt; do umount -l "$mnt" 2>/dev/null || true; done
    rm -rf --one-file-system -- "$dir"
}

log() { printf '[ci-setup] %s\n' "$*" >&2; }
DIED=0
die() { printf '[ci-setup] FAILED: %s\n' "$*" >&2; DIED=1; exit 1; }

# Expected failures go through die() with a reason. For anything else that
# trips set -e, remember the command (ERR) and report it once, on exit.
set -E
FAILED_CMD=""
trap 'FAILED_CMD="${FAILED_CMD:-line $LINENO: $BASH_COMMAND}"' ERR
on_exit() {
    local rc=$?
    cleanup
    if ((rc != 0 && DIED == 0)); then
        printf '[ci-setup] FAILED: unexpected error (exit %d) at %s\n' "$rc" "${FAILED_CMD:-unknown}" >&2
    fi
}
trap on_exit EXIT

# --------------------------------------------------------------------------
# 1. Debian packages
# --------------------------------------------------------------------------
install_packages() {
    # charliecloud (ch-convert, ch-run): an HPC runtime that skips ENTRYPOINT and image ENV,
    # for tests/integration/test_launch.py. chromium (headless) and a font render report.html
    # for tests/integration/test_catalog.py.
    # qemu-user-static, binfmt-support and mmdebstrap: arm64 images (emulated builds and probes,
    # the arm64 bases). podman: its Docker API (podman system service), as HPC sites run it, for
    # tests/integration/test_podman.py.
    local pkgs=(docker.io debootstrap docker-registry apache2-utils curl iproute2 charliecloud chromium fonts-dejavu-core
        qemu-user-static binfmt-support mmdebstrap podman)
    local missing=() p
    for p in "${pkgs[@]}"; do
        # (dpkg -s, but also rejecting removed-but-not-purged packages)
        if [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)" != "install ok installed" ]]; then
            missing+=("$p")
        fi
    done
    if ((${#missing[@]} == 0)); then
        log "packages already installed"
        return
    fi
    # docker.io and docker-registry ship init scripts that would start a
    # dockerd with the default 172.17.x bridge and a registry on :5000 with
    # Debian's config. Forbid service starts during the install (the usual
    # policy-rc.d trick) unless the machine already has such a policy.
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod +x /usr/sbin/policy-rc.d
        CLEANUP_PATHS+=(/usr/sbin/policy-rc.d)
    fi
    log "installing: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq || die "apt-get update failed"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
        || die "apt-get install ${missing[*]} failed"
}

# trixie_download DIR PACKAGE...: the packages' .debs from Debian trixie into DIR, through a
# sources list and apt state kept apart from the system's (whose apt state is never touched).
trixie_download() {
    local dest="$1" apt_dir="${CACHE_DIR}/apt-trixie"
    shift
    mkdir -p "${apt_dir}/lists/partial" "${apt_dir}/archives/partial" "$dest"
    printf 'deb %s trixie main\n' "$MIRROR" >"${apt_dir}/sources.list"
    local opts=(-o "Dir::Etc::sourcelist=${apt_dir}/sources.list" -o "Dir::Etc::sourceparts=/nonexistent"
                -o "Dir::State::Lists=${apt_dir}/lists" -o "Dir::Cache::Archives=${apt_dir}/archives"
                -o "APT::Get::List-Cleanup=0")
    log "fetching $* from Debian trixie"
    apt-get "${opts[@]}" update -qq || die "apt-get update against trixie failed"
    (cd "$dest" && apt-get "${opts[@]}" download "$@" 2>/dev/null) || die "apt-get download $* from trixie failed"
}

# --------------------------------------------------------------------------
# 1b. docker buildx (BuildKit builds): Debian 12 has no package; Debian 13's
#     docker-buildx is one Go binary that needs only libc6 (>= 2.34). Fetch the
#     .deb against a trixie sources list kept apart from the system's (the
#     system's apt state is never touched), unpack it, install the CLI plugin.
# --------------------------------------------------------------------------
readonly CLI_PLUGIN_DIR="/usr/libexec/docker/cli-plugins"

# install_trixie_cli_plugin NAME -> `docker NAME` answers: from Debian 13's
# docker-NAME .deb (one Go binary, libc6 >= 2.34), unpacked into the CLI's
# plugin folder, unless the plugin answers already.
install_trixie_cli_plugin() {
    local name="$1" work
    if docker "$name" version >/dev/null 2>&1; then
        log "$name present: $(docker "$name" version 2>/dev/null | head -n1)"
        return 0
    fi
    work="$(mktemp -d)"
    CLEANUP_PATHS+=("$work")
    trixie_download "$work" "docker-$name"
    dpkg-deb -x "$work/docker-${name}"_*.deb "$work/root"
    install -D -m 0755 "$work/root/usr/libexec/docker/cli-plugins/docker-$name" "${CLI_PLUGIN_DIR}/docker-$name"
    docker "$name" version >/dev/null 2>&1 || die "docker $name does not answer after install"
    log "$name installed: $(docker "$name" version | head -n1)"
}

# 1b'. docker compose (the test session's services, through pytest-docker):
#      Debian 13's docker-compose 2.x, installed the same way.

# --------------------------------------------------------------------------
# 1c. cosign (signing and verifying images, `--sign` / `imagefactory verify`):
#     Debian 13's cosign 2.x, one Go binary (libc6 >= 2.34), fetched and
#     unpacked the way buildx is. The .deb is kept under the cache, so a rerun
#     on a machine that lost /usr/local/bin/cosign installs it offline.
#     cosign 3 changes the signing flags and defaults (bundle format,
#     --signing-config): an unknown major version is refused, not used.
# --------------------------------------------------------------------------
readonly COSIGN_BIN="/usr/local/bin/cosign"
readonly COSIGN_STAMP="/usr/local/lib/imagefactory-cosign.version"
readonly COSIGN_MAJOR="2"

# cosign_major BINARY [VERSION] -> prints cosign's major version: from
# `BINARY version` (GitVersion: v2.5.0 -> 2); Debian's build says "devel"
# there, so then from VERSION (the .deb's Version field, 2.5.0-2+b5), else
# from the stamp an earlier install wrote. Nothing when none of them says.
cosign_major() {
    local v
    v="$("$1" version 2>/dev/null | tr -d '\r' | sed -n 's/^GitVersion:[[:space:]]*//p' | head -n1 || true)"
    if ! [[ "$v" =~ ^v?[0-9]+\.[0-9]+\.[0-9]+ ]]; then
        v="${2:-}"
        [[ -n "$v" || ! -r "$COSIGN_STAMP" ]] || v="$(head -n1 "$COSIGN_STAMP")"
    fi
    [[ "$v" =~ ^v?([0-9]+)\.[0-9]+\.[0-9]+([-+~.][A-Za-z0-9.+~-]*)?$ ]] && printf '%s\n' "${BASH_REMATCH[1]}"
    return 0
}

# check_cosign BINARY [VERSION]: refuse anything but cosign 2.x, with the reason.
check_cosign() {
    local major
    major="$(cosign_major "$@")"
    [[ -n "$major" ]] || die "$1: cannot tell cosign's version (\`$1 version\` gives no GitVersion x.y.z); install cosign ${COSIGN_MAJOR}.x from Debian trixie"
    [[ "$major" == "$COSIGN_MAJOR" ]] ||
        die "$1 is cosign ${major}.x; imagefactory drives cosign ${COSIGN_MAJOR}.x (cosign 3 changed the signing flags and defaults): install cosign ${COSIGN_MAJOR}.x"
}

install_cosign() {
    if [[ -x "$COSIGN_BIN" ]]; then
        check_cosign "$COSIGN_BIN"
        log "cosign present: $COSIGN_BIN (cosign $(cosign_major "$COSIGN_BIN").x)"
        return 0
    fi
    local work deb version
    mkdir -p "${CACHE_DIR}/debs"
    deb="$(find "${CACHE_DIR}/debs" -name 'cosign_*.deb' | sort | tail -n1)"
    if [[ -z "$deb" ]]; then
        trixie_download "${CACHE_DIR}/debs" cosign
        deb="$(find "${CACHE_DIR}/debs" -name 'cosign_*.deb' | sort | tail -n1)"
    fi
    version="$(dpkg-deb -f "$deb" Version)" || die "$deb: not a readable .deb"
    work="$(mktemp -d)"
    CLEANUP_PATHS+=("$work")
    dpkg-deb -x "$deb" "$work/root" || die "dpkg-deb -x $deb failed"
    check_cosign "$work/root/usr/bin/cosign" "$version"
    install -D -m 0755 "$work/root/usr/bin/cosign" "$COSIGN_BIN"
    printf '%s\n' "$version" >"$COSIGN_STAMP"
    log "cosign installed: $COSIGN_BIN ($version)"
}

# --------------------------------------------------------------------------
# 1d. QEMU through binfmt_misc: the kernel hands arm64 binaries to
#     qemu-aarch64-static. The package's service would do this, but
#     policy-rc.d (or a machine without systemd) blocks it, so by hand. The F
#     flag (the interpreter opened at registration) lets containers use it.
# --------------------------------------------------------------------------
readonly BINFMT_DIR="/proc/sys/fs/binfmt_misc"
enable_binfmt() {
    if [[ ! -e "$BINFMT_DIR/register" ]]; then
        mount -t binfmt_misc binfmt_misc "$BINFMT_DIR" || die "cannot mount binfmt_misc on $BINFMT_DIR"
    fi
    if [[ "$(head -n1 "$BINFMT_DIR/qemu-aarch64" 2>/dev/null || true)" != enabled ]]; then
        update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || update-binfmts --import qemu-aarch64 >/dev/null 2>&1 ||
            die "update-binfmts --enable qemu-aarch64 failed"
    fi
    [[ "$(head -n1 "$BINFMT_DIR/qemu-aarch64" 2>/dev/null || true)" == enabled ]] ||
        die "binfmt_misc has no enabled qemu-aarch64 handler after update-binfmts"
    grep -q '^flags: .*F' "$BINFMT_DIR/qemu-aarch64" ||
        die "the qemu-aarch64 binfmt handler lacks the F flag: containers could not find the interpreter"
    log "binfmt: qemu-aarch64 enabled"
}

# --------------------------------------------------------------------------
# 2. Docker engines (the current one on the default socket, the legacy one on
#    its own): scripts/ci-engines.sh. No bridge/iptables: these machines may
#    only talk to loopback and the package mirrors; builds use host
#    networking, smoke tests network none.
# --------------------------------------------------------------------------
# shellcheck source=scripts/ci-engines.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/ci-engines.sh"

# --------------------------------------------------------------------------
# 3. Base images (debootstrap -> cached tarball -> docker import)
# --------------------------------------------------------------------------

# make_rootfs_tar TARBALL [debootstrap --include list]
# Builds the tarball only if it is not cached. Written under a temporary name
# and renamed, so an interrupted run never leaves a truncated cache entry.
make_rootfs_tar() {
    local tarball="$1" include="${2:-}"
    if [[ -s "$tarball" ]]; then
        log "cached: $tarball"
        return
    fi
    local root
    root="$(mktemp -d "${CACHE_DIR}/rootfs.XXXXXX")"
    CLEANUP_PATHS+=("$root")
    local args=(--variant=minbase)
    [[ -n "$include" ]] && args+=("--include=$include")
    log "debootstrap ${args[*]} $SUITE (takes ~30 s)"
    debootstrap "${args[@]}" "$SUITE" "$root" "$MIRROR" >"${root}.log" 2>&1 || {
        tail -n 20 "${root}.log" >&2 || true
        die "debootstrap for $(basename "$tarball") failed (log: ${root}.log)"
    }
    rm -f "${root}.log"
    # Plain http: containers do not trust the TLS-intercepting proxy's CA.
    echo "deb $MIRROR $SUITE main" >"$root/etc/apt/sources.list"
    # Keep the image small, as the official slim images are.
    rm -rf "${root:?}"/var/cache/apt/archives/*.deb "${root:?}"/var/lib/apt/lists/*
    rm -rf "${root:?}"/dev/* "${root:?}"/proc/* "${root:?}"/sys/* "${root:?}"/tmp/* 2>/dev/null || true
    tar --numeric-owner -C "$root" -cf "${tarball}.tmp" . || die "tar of $root failed"
    mv -f "${tarball}.tmp" "$tarball"
    remove_tree "$root"
}

# import_image TARBALL IMAGE [extra --change ...]
import_image() {
    local tarball="$1" image="$2"
    shift 2
    if docker image inspect "$image" >/dev/null 2>&1; then
        log "image present: $image"
        return
    fi
    log "importing $image"
    docker import \
        --change 'CMD ["/bin/bash"]' \
        --change "ENV PATH=$IMAGE_PATH" \
        "$@" "$tarball" "$image" >/dev/null || die "docker import $image failed"
}

make_base_images() {
    mkdir -p "$CACHE_DIR"
    # Remove leftovers of an interrupted earlier run.
    local leftover
    for leftover in "$CACHE_DIR"/rootfs.* "$CACHE_DIR"/context.* "$CACHE_DIR"/*.tar.tmp "$CACHE_DIR"/*.partial.tar; do
        remove_tree "$leftover"
    done
    local minbase="$CACHE_DIR/bookworm-minbase.tar"
    local python="$CACHE_DIR/bookworm-python.tar"
    # Only debootstrap when the image is missing and the tarball too: a
    # machine that already has the images does not need the cache.
    # Imported as the per-arch name (IMAGE-amd64); IMAGE itself is the two-arch list, pulled from
    # the base registry once it is there (push_base_images). In the containerd image store the
    # pulled IMAGE is the list itself: tagging it as IMAGE-amd64 would push a list under that name.
    docker image inspect "$DEBIAN_IMAGE-amd64" >/dev/null 2>&1 || make_rootfs_tar "$minbase"
    docker image inspect "$PYTHON_IMAGE-amd64" >/dev/null 2>&1 ||
        make_rootfs_tar "$python" "python3,python3-venv,ca-certificates"
    import_image "$minbase" "$DEBIAN_IMAGE-amd64"
    # Like the official python image: a UTF-8 locale for Python's I/O.
    import_image "$python" "$PYTHON_IMAGE-amd64" --change 'ENV LANG=C.UTF-8'
}

# make_foreign_rootfs_tar TARBALL ARCH PACKAGES: a Debian root of another
# architecture, unpacked without running its packages' scripts under QEMU
# (mmdebstrap's extract variant, ~15 s, then scripts/foreign-rootfs.sh does
# what the images need of those scripts; a full emulated debootstrap takes
# 332-454 s on 2 cores). Cached like the amd64 tarballs.
make_foreign_rootfs_tar() {
    local tarball="$1" arch="$2" include="$3"
    if [[ -s "$tarball" ]]; then
        log "cached: $tarball"
        return
    fi
    log "mmdebstrap --variant=extract --architectures=$arch $SUITE (takes ~1 min)"
    # (mmdebstrap tells a tarball from a directory by the name's ending)
    local partial="${tarball%.tar}.partial.tar" hook
    hook="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/foreign-rootfs.sh"
    mmdebstrap --variant=extract --architectures="$arch" \
        --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
        --include='?essential' --include="$include" \
        --extract-hook="bash $hook \"\$1\"" \
        "$SUITE" "$partial" "$MIRROR" >"${tarball}.log" 2>&1 || {
        tail -n 20 "${tarball}.log" >&2 || true
        rm -f "$partial"
        die "mmdebstrap for $(basename "$tarball") failed (log: ${tarball}.log)"
    }
    rm -f "${tarball}.log"
    mv -f "$partial" "$tarball"
}

# build_foreign_image TARBALL IMAGE PLATFORM [ENV ...]: `docker import
# --platform` records the host's architecture whatever it is told; a BuildKit
# build of FROM scratch + ADD records the right one (9 s).
build_foreign_image() {
    local tarball="$1" image="$2" platform="$3"
    shift 3
    if [[ "$(docker image inspect -f '{{.Os}}/{{.Architecture}}' "$image" 2>/dev/null || true)" == "$platform" ]]; then
        log "image present: $image"
        return
    fi
    local work env
    work="$(mktemp -d "${CACHE_DIR}/context.XXXXXX")"
    CLEANUP_PATHS+=("$work")
    ln "$tarball" "$work/rootfs.tar" 2>/dev/null || cp "$tarball" "$work/rootfs.tar"
    {
        echo "FROM scratch"
        echo "ADD rootfs.tar /"
        echo "ENV PATH=$IMAGE_PATH"
        for env in "$@"; do echo "ENV $env"; done
        echo 'CMD ["/bin/bash"]'
    } >"$work/Dockerfile"
    log "building $image ($platform)"
    # No attestations: in the containerd image store they would make the image an index of
    # two manifests, where the base list needs the arm64 image's own manifest.
    BUILDX_NO_DEFAULT_ATTESTATIONS=1 docker buildx build --platform "$platform" --network host -q --load \
        -t "$image" "$work" >/dev/null ||
        die "docker buildx build of $image ($platform) failed"
    [[ "$(docker image inspect -f '{{.Os}}/{{.Architecture}}' "$image")" == "$platform" ]] ||
        die "$image is not $platform after its build"
    remove_tree "$work"
}

make_foreign_base_images() {
    local minbase="$CACHE_DIR/bookworm-minbase-arm64.tar"
    local python="$CACHE_DIR/bookworm-python-arm64.tar"
    docker image inspect "$DEBIAN_IMAGE-arm64" >/dev/null 2>&1 || make_foreign_rootfs_tar "$minbase" arm64 apt,passwd
    docker image inspect "$PYTHON_IMAGE-arm64" >/dev/null 2>&1 ||
        make_foreign_rootfs_tar "$python" arm64 apt,passwd,python3,python3-venv,ca-certificates
    build_foreign_image "$minbase" "$DEBIAN_IMAGE-arm64" linux/arm64
    build_foreign_image "$python" "$PYTHON_IMAGE-arm64" linux/arm64 LANG=C.UTF-8
}

# --------------------------------------------------------------------------
# 4. Registries
# --------------------------------------------------------------------------

# http_code URL -> prints the HTTP status (000 when nothing answers).
http_code() {
    curl -s -o /dev/null -w '%{http_code}' --max-time 3 --noproxy '*' "$1" || true
}

# listener_pids PORT -> PIDs of processes listening on 127.0.0.1/any:PORT.
listener_pids() {
    ss -ltnpH "sport = :$1" 2>/dev/null | grep -o 'pid=[0-9]*' | cut -d= -f2 | sort -u || true
}

# write_registry_config PORT DATA_DIR [HTPASSWD_FILE] -> prints config path
write_registry_config() {
    local port="$1" data="$2" htpasswd="${3:-}"
    local conf="$CACHE_DIR/registry-$port.yml"
    {
        echo "version: 0.1"
        echo "log:"
        echo "  level: info"
        echo "storage:"
        echo "  filesystem:"
        echo "    rootdirectory: $data"
        echo "  delete:"
        echo "    enabled: true"
        echo "http:"
        echo "  addr: 127.0.0.1:$port"
        if [[ -n "$htpasswd" ]]; then
            echo "auth:"
            echo "  htpasswd:"
            echo "    realm: imagefactory-ci"
            echo "    path: $htpasswd"
        fi
    } >"$conf.tmp"
    # Rewriting an identical file would not matter, but keep mtimes stable.
    if cmp -s "$conf.tmp" "$conf"; then rm -f "$conf.tmp"; else mv -f "$conf.tmp" "$conf"; fi
    echo "$conf"
}

# start_registry PORT CONFIG EXPECTED_CODE
# Skips a registry that already answers and was started with CONFIG. Anything
# else on the port (e.g. Debian's packaged service with its own config) is a
# docker-registry we stop; a foreign program there is an error.
start_registry() {
    local port="$1" conf="$2" want="$3"
    local url="http://127.0.0.1:$port/v2/" pid ours=0 others=() cmd
    for pid in $(listener_pids "$port"); do
        cmd="$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null || true)"
        if [[ "$cmd" == *"serve $conf"* ]]; then ours=1; else others+=("$pid"); fi
    done
    if ((ours)) && ((${#others[@]} == 0)) && [[ "$(http_code "$url")" == "$want" ]]; then
        log "registry :$port already running"
        return
    fi
    # The packaged service, if systemd runs it, would come back: disable it.
    if [[ -d /run/systemd/system ]]; then
        systemctl disable --now docker-registry.service >/dev/null 2>&1 || true
    fi
    # Whatever listens now is a stray or a broken copy of ours: stop it.
    local exe
    for pid in $(listener_pids "$port"); do
        exe="$(readlink "/proc/$pid/exe" 2>/dev/null || true)"
        [[ "$(basename "$exe")" == docker-registry* ]] ||
            die "port $port is taken by pid $pid ($exe), not a docker-registry; stop it first"
        log "stopping registry pid $pid on :$port (not started with $conf, or not answering)"
        kill "$pid" 2>/dev/null || true
    done
    local i
    for ((i = 0; i < 20; i++)); do
        [[ -z "$(listener_pids "$port")" ]] && break
        sleep 0.5
    done
    # Blobs only the manifests that test runs deleted named (each run deletes its own pushes as
    # it ends: tests/integration/helpers.remove_run_pushes) are freed here, while nothing
    # serves this data; a collection that fails costs disk, not the run.
    local root
    root="$(sed -n 's/^ *rootdirectory: //p' "$conf")"
    if [[ -d "$root/docker/registry/v2/repositories" ]] &&
        ! docker-registry garbage-collect "$conf" >"/tmp/registry-$port-gc.log" 2>&1; then
        log "registry :$port: garbage collection failed (/tmp/registry-$port-gc.log); starting it anyway"
    fi
    log "starting registry :$port"
    setsid docker-registry serve "$conf" </dev/null >"/tmp/registry-$port.log" 2>&1 9>&- &
    for ((i = 0; i < 60; i++)); do
        [[ "$(http_code "$url")" == "$want" ]] && return
        sleep 0.5
    done
    tail -n 20 "/tmp/registry-$port.log" >&2 || true
    die "registry :$port did not answer $want on $url within 30 s (log: /tmp/registry-$port.log)"
}

start_registries() {
    local data="$CACHE_DIR/registry-data"
    mkdir -p "$data/5000"

    local conf
    conf="$(write_registry_config 5000 "$data/5000")"
    start_registry 5000 "$conf" 200
}

# free_test_services: the test session starts its registry on 5001 and its index itself
# (tests/services/compose.yaml). What holds 5001 now is stopped: the host registry an earlier
# ci-setup started there, and the services of a test session that was killed before its `down`
# (compose projects named imagefactory-test-*), with their volumes. Anything else there is an error.
free_test_services() {
    local project pid exe
    for project in $(docker ps -a --format '{{.Label "com.docker.compose.project"}}' | sort -u); do
        [[ "$project" == imagefactory-test-* ]] || continue
        log "removing the test services a killed run left ($project)"
        docker compose -p "$project" down -v --remove-orphans >/dev/null 2>&1 ||
            die "docker compose -p $project down -v failed"
    done
    for pid in $(listener_pids 5001); do
        exe="$(readlink "/proc/$pid/exe" 2>/dev/null || true)"
        [[ "$(basename "$exe")" == docker-registry* ]] ||
            die "port 5001 is taken by pid $pid ($exe); the test session's registry needs it: stop it first"
        log "stopping the host registry on :5001 (the test session runs its own now)"
        kill "$pid" 2>/dev/null || true
    done
    rm -rf "$CACHE_DIR/registry-data/5001" "$CACHE_DIR/registry-5001.yml" "$CACHE_DIR/registry-5001.htpasswd"
}

# registry_digest IMAGE -> the manifest digest the base registry serves for
# IMAGE (empty when it has none). Docker's or OCI's manifest: the containerd
# image store pushes OCI media types.
registry_digest() {
    local ref="${1#*/}" # strip host:port
    curl -s -I --max-time 5 --noproxy '*' \
        -H 'Accept: application/vnd.docker.distribution.manifest.v2+json, application/vnd.oci.image.manifest.v1+json' \
        "http://$BASE_REGISTRY/v2/${ref%:*}/manifests/${ref##*:}" |
        tr -d '\r' | awk -F': ' 'tolower($1) == "docker-content-digest" { print $2 }' || true
}

# push_unless_served IMAGE: push unless the registry already serves this very
# image: after a re-import (new image ID) the tag in the registry would
# otherwise be stale.
push_unless_served() {
    local image="$1" digest
    digest="$(registry_digest "$image")"
    if [[ -n "$digest" ]] && docker image inspect -f '{{join .RepoDigests " "}}' "$image" |
        grep -qF -- "@$digest"; then
        log "registry has $image"
        return
    fi
    log "pushing $image"
    docker push -q "$image" >/dev/null || die "docker push $image failed"
    [[ -n "$(registry_digest "$image")" ]] || die "registry does not serve $image after push"
}

# list_members IMAGE -> "os/arch digest" lines of the list the base registry
# serves under IMAGE (nothing when it serves no list there).
list_members() {
    local ref="${1#*/}"
    curl -s --max-time 5 --noproxy '*' --max-filesize 65536 \
        -H 'Accept: application/vnd.docker.distribution.manifest.list.v2+json, application/vnd.oci.image.index.v1+json' \
        "http://$BASE_REGISTRY/v2/${ref%:*}/manifests/${ref##*:}" | python3 -c '
import json, sys
try:
    doc = json.load(sys.stdin)
except ValueError:
    sys.exit(0)
for m in doc.get("manifests") or []:
    p = m.get("platform") or {}
    print("%s/%s %s" % (p.get("os"), p.get("architecture"), m.get("digest")))
' | LC_ALL=C sort || true
}

# Each base: its amd64 image and its arm64 image under per-arch tags
# (IMAGE-amd64, IMAGE-arm64), and IMAGE itself a list of the two, as Docker Hub
# serves python:3.11-slim-bookworm. The local IMAGE is then a pull of the list
# (RepoDigests: the list's digest; its amd64 image on this host).
push_base_images() {
    local image amd arm want
    for image in "$DEBIAN_IMAGE" "$PYTHON_IMAGE"; do
        push_unless_served "$image-amd64"
        push_unless_served "$image-arm64"
        amd="$(registry_digest "$image-amd64")"
        arm="$(registry_digest "$image-arm64")"
        want="$(printf 'linux/amd64 %s\nlinux/arm64 %s\n' "$amd" "$arm" | LC_ALL=C sort)"
        if [[ "$(list_members "$image")" == "$want" ]]; then
            log "registry has the list $image (linux/amd64, linux/arm64)"
        else
            log "merging $image: linux/amd64 + linux/arm64"
            docker buildx imagetools create -t "$image" "$image-amd64@$amd" "$image-arm64@$arm" >/dev/null 2>&1 ||
                die "docker buildx imagetools create -t $image failed"
            [[ "$(list_members "$image")" == "$want" ]] || die "the registry does not serve $image as the list just made"
        fi
        docker pull -q "$image" >/dev/null || die "docker pull $image (the list) failed"
        [[ "$(docker image inspect -f '{{.Architecture}}' "$image")" == amd64 ]] ||
            die "$image is not the amd64 image after pulling its list"
    done
}

# --------------------------------------------------------------------------
# 5. Smoke check and summary
# --------------------------------------------------------------------------
smoke_check() {
    # The python stand-in must make venvs offline, as tests build with it.
    docker run --rm --network none "$PYTHON_IMAGE" \
        sh -c 'python3.11 -m venv /tmp/v && /tmp/v/bin/python -c "import sys"' \
        >/dev/null 2>&1 || die "python3.11 -m venv fails in $PYTHON_IMAGE"
    # The arm64 stand-in runs through QEMU, the way the arm64 cells' builds and probes do.
    [[ "$(docker run --rm --network none --platform linux/arm64 "$PYTHON_IMAGE-arm64" \
        sh -c 'uname -m; python3.11 -c "import ssl, venv"; echo ok' 2>/dev/null | tr '\n' ' ')" == "aarch64 ok " ]] ||
        die "$PYTHON_IMAGE-arm64 does not run python3.11 as aarch64 (is qemu-aarch64 registered with binfmt_misc?)"
}

write_env_file() {
    cat >"$CACHE_DIR/env.sh.tmp" <<EOF
# Written by scripts/ci-setup.sh: the registries it started.
export IMAGEFACTORY_TEST_REGISTRY=$TEST_REGISTRY IMAGEFACTORY_TEST_REGISTRY_USER=$TEST_USER IMAGEFACTORY_TEST_REGISTRY_PASSWORD=$TEST_PASSWORD IMAGEFACTORY_BASE_REGISTRY=$BASE_REGISTRY IMAGEFACTORY_LEGACY_DOCKER_HOST=$LEGACY_HOST IMAGEFACTORY_PODMAN_HOST=$PODMAN_HOST
EOF
    mv -f "$CACHE_DIR/env.sh.tmp" "$CACHE_DIR/env.sh"
}

summary() {
    local version legacy
    version="$(docker version -f '{{.Server.Version}} (API {{.Server.APIVersion}})')"
    legacy="$(docker -H "$LEGACY_HOST" version -f '{{.Server.Version}} (API {{.Server.APIVersion}})')"
    cat <<EOF
imagefactory CI setup ready
  engine:         docker $version, containerd image store (default socket)
  legacy engine:  docker $legacy, overlay2 ($LEGACY_HOST)
  podman:         $(podman --version) ($PODMAN_HOST)
  base registry:  http://$BASE_REGISTRY (no auth)
  test registry:  http://$TEST_REGISTRY (user $TEST_USER, password $TEST_PASSWORD), started by each test session
  compose:        $(docker compose version --short)
  images:
EOF
    docker image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' \
        | grep -F -e "$DEBIAN_IMAGE" -e "$PYTHON_IMAGE" | sed 's/^/    /'
    echo "  env:            source $CACHE_DIR/env.sh"
}

main() {
    ((EUID == 0)) || die "must run as root"
    mkdir -p "$CACHE_DIR"
    # Two CI jobs on one machine must not debootstrap into the same cache.
    # (Daemons started below close fd 9, or they would hold the lock forever.)
    exec 9>"$CACHE_DIR/.lock"
    flock -w 900 9 || die "another ci-setup.sh holds $CACHE_DIR/.lock"
    install_packages
    enable_binfmt
    install_current_engine
    start_engines
    install_trixie_cli_plugin buildx
    install_trixie_cli_plugin compose
    install_cosign
    make_base_images
    make_foreign_base_images
    start_registries
    free_test_services
    push_base_images
    legacy_bases "$DEBIAN_IMAGE" "$PYTHON_IMAGE"
    start_podman_service "$BASE_REGISTRY" "$TEST_REGISTRY"
    podman_bases "$PYTHON_IMAGE"
    smoke_check
    write_env_file
    summary
}

main "$@"
