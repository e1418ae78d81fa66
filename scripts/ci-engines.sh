# ci-engines.sh -- the two Docker engines of a CI machine, sourced by ci-setup.sh (it uses
# ci-setup's log, die, CACHE_DIR, MIRROR and CLEANUP_PATHS).
#
#   * the CURRENT engine, the one every client reaches by default (/var/run/docker.sock):
#     Debian 13's docker.io (26.1.5 today) on its own containerd (1.7), with the containerd
#     image store ("containerd-snapshotter"), as Docker 29's fresh installs and Docker Desktop
#     have it. Debian 13's binaries are unpacked (dpkg-deb -x) into a prefix of their own; they
#     run on Debian 12 except its runc (glibc 2.38), so Debian 12's runc runs under them.
#   * the LEGACY engine: Debian 12's docker.io 20.10 (overlay2, the graph-driver image store,
#     BuildKit v0.8) on a socket of its own (LEGACY_HOST below), for the module that keeps the
#     old store supported (tests/integration/test_legacy_engine.py).
#
# Each engine has its own data root, exec root, pid file and containerd, so the two never share
# a file. Idempotent: an engine that answers with the expected version and store is left alone;
# a 20.10 engine found on the default socket (a machine set up before the current engine came)
# is stopped and started again on its own socket, keeping its data root.

readonly CURRENT_PREFIX="/opt/imagefactory/engine-current"
readonly CURRENT_SOCK="/var/run/docker.sock"
readonly CURRENT_DATA="/var/lib/imagefactory-engine"
readonly CURRENT_RUN="/run/imagefactory-engine"
readonly CURRENT_CONTAINERD_SOCK="${CURRENT_RUN}/containerd/containerd.sock"
readonly LEGACY_RUN="/run/imagefactory-legacy"
readonly LEGACY_SOCK="${LEGACY_RUN}/docker.sock"
readonly LEGACY_HOST="unix://${LEGACY_SOCK}"
readonly LEGACY_DATA="/var/lib/docker"
readonly CURRENT_MAJOR="26"  # Debian 13's docker.io; a newer trixie point release keeps it

# engine_answer HOST FORMAT -> what `docker -H HOST info -f FORMAT` prints (empty when nothing answers)
engine_answer() {
    timeout 10 docker -H "$1" info -f "$2" 2>/dev/null || true
}

# wait_engine HOST LOG: wait until HOST answers `docker info` (60 s), else die with LOG's tail.
wait_engine() {
    local host="$1" logfile="$2" i
    for ((i = 0; i < 60; i++)); do
        timeout 10 docker -H "$host" info >/dev/null 2>&1 && return 0
        sleep 1
    done
    tail -n 20 "$logfile" >&2 || true
    die "the engine at $host did not answer 'docker info' within 60 s (log: $logfile)"
}

# stop_pid PIDFILE: stop the daemon it names (TERM, then KILL after 20 s) and remove the file.
stop_pid() {
    local pidfile="$1" pid i
    [[ -s "$pidfile" ]] || return 0
    pid="$(head -n1 "$pidfile")"
    if [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null; then
        kill "$pid" 2>/dev/null || true
        for ((i = 0; i < 40; i++)); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.5
        done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$pidfile"
}

# install_current_engine: docker.io, containerd and tini from Debian trixie (the .debs kept
# under the cache, so a rerun installs offline), unpacked into CURRENT_PREFIX/root, and a bin/
# of links that goes first on the engine's PATH.
install_current_engine() {
    local stamp="${CURRENT_PREFIX}/installed" debs="${CACHE_DIR}/debs" pkg deb
    if [[ -s "$stamp" && -x "${CURRENT_PREFIX}/bin/dockerd" ]]; then
        log "current engine present: $(head -n1 "$stamp")"
        return 0
    fi
    mkdir -p "$debs"
    local missing=()
    for pkg in docker.io containerd tini; do
        compgen -G "${debs}/${pkg}_*.deb" >/dev/null || missing+=("$pkg")
    done
    if ((${#missing[@]})); then
        trixie_download "$debs" "${missing[@]}"  # (scripts/ci-setup.sh)
    fi
    local root="${CURRENT_PREFIX}/root" versions=()
    rm -rf "${CURRENT_PREFIX}.tmp"
    mkdir -p "${CURRENT_PREFIX}.tmp/root" "${CURRENT_PREFIX}.tmp/bin"
    CLEANUP_PATHS+=("${CURRENT_PREFIX}.tmp")
    for pkg in docker.io containerd tini; do
        deb="$(find "$debs" -name "${pkg}_*.deb" | sort | tail -n1)"
        dpkg-deb -x "$deb" "${CURRENT_PREFIX}.tmp/root" || die "dpkg-deb -x $deb failed"
        versions+=("$pkg $(dpkg-deb -f "$deb" Version)")
    done
    local bin="${CURRENT_PREFIX}.tmp/bin"
    ln -s "${root}/usr/sbin/dockerd" "$bin/dockerd"
    ln -s "${root}/usr/sbin/docker-proxy" "$bin/docker-proxy"
    ln -s "${root}/usr/bin/tini-static" "$bin/docker-init"
    ln -s "${root}/usr/bin/containerd" "$bin/containerd"
    ln -s "${root}/usr/bin/containerd-shim-runc-v2" "$bin/containerd-shim-runc-v2"
    ln -s /usr/sbin/runc "$bin/runc"  # Debian 13's runc needs glibc 2.38
    printf '%s\n' "${versions[*]}" >"${CURRENT_PREFIX}.tmp/installed"
    rm -rf "$CURRENT_PREFIX"
    mv "${CURRENT_PREFIX}.tmp" "$CURRENT_PREFIX"
    log "current engine installed: ${versions[*]}"
}

# start_legacy_engine: Debian 12's dockerd 20.10 on LEGACY_HOST. A 20.10 engine on the default
# socket (started by an earlier ci-setup, pid file /var/run/docker.pid) moves to its own socket.
start_legacy_engine() {
    if [[ -n "$(engine_answer "$LEGACY_HOST" '{{.ServerVersion}}')" ]]; then
        log "legacy engine already running ($LEGACY_HOST)"
        return 0
    fi
    local found
    found="$(engine_answer "unix://${CURRENT_SOCK}" '{{.ServerVersion}}')"
    if [[ "$found" == 20.* ]]; then
        log "moving the $found engine off the default socket to $LEGACY_HOST"
        stop_pid /var/run/docker.pid
    fi
    mkdir -p "$LEGACY_RUN"
    printf '{}\n' >"${LEGACY_RUN}/daemon.json"
    log "starting the legacy engine (dockerd 20.10) on $LEGACY_HOST"
    # Debian 12's PATH: its own containerd, shim and runc.
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin setsid /usr/sbin/dockerd \
        --config-file "${LEGACY_RUN}/daemon.json" -H "$LEGACY_HOST" --data-root "$LEGACY_DATA" \
        --exec-root "${LEGACY_RUN}/exec" --pidfile "${LEGACY_RUN}/dockerd.pid" \
        --bridge=none --iptables=false </dev/null >/tmp/dockerd-legacy.log 2>&1 9>&- &
    wait_engine "$LEGACY_HOST" /tmp/dockerd-legacy.log
}

# stop_foreign_engine VERSION: the engine answering on the default socket is not ours (a GitHub
# runner's Docker, a distribution's dockerd): stop it, when told to (IMAGEFACTORY_CI_REPLACE_ENGINE=1,
# as .github/workflows/ci.yml does), so that the suite's engine takes the default socket. Under
# systemd its units are stopped (the socket unit too, or the next client would start it again);
# else the dockerd that listens on the socket gets TERM. Its data root and containerd stay.
stop_foreign_engine() {
    local found="$1" pid exe i
    [[ "${IMAGEFACTORY_CI_REPLACE_ENGINE:-}" == 1 ]] ||
        die "the engine on $CURRENT_SOCK is $found, not Debian 13's ${CURRENT_MAJOR}.x with the containerd image store: stop it first, or set IMAGEFACTORY_CI_REPLACE_ENGINE=1 to let this script stop it (a CI runner's engine)"
    log "stopping the engine on $CURRENT_SOCK ($found): IMAGEFACTORY_CI_REPLACE_ENGINE=1"
    if [[ -d /run/systemd/system ]] && systemctl is-active --quiet docker.service docker.socket 2>/dev/null; then
        systemctl stop docker.socket docker.service || die "systemctl stop docker.socket docker.service failed"
    fi
    for pid in $(ss -xlpH "src $CURRENT_SOCK" 2>/dev/null | grep -o 'pid=[0-9]*' | cut -d= -f2 | sort -u); do
        exe="$(readlink "/proc/$pid/exe" 2>/dev/null || true)"
        [[ "$(basename "$exe")" == dockerd* ]] ||
            die "$CURRENT_SOCK is served by pid $pid ($exe), not a dockerd: stop it first"
        kill "$pid" 2>/dev/null || true
        for ((i = 0; i < 60; i++)); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.5
        done
        kill -0 "$pid" 2>/dev/null && die "the dockerd on $CURRENT_SOCK (pid $pid) did not stop within 30 s"
    done
    [[ -z "$(engine_answer "unix://${CURRENT_SOCK}" '{{.ServerVersion}}')" ]] ||
        die "an engine still answers on $CURRENT_SOCK after stopping it"
    rm -f "$CURRENT_SOCK"
}

# start_current_engine: its containerd, then its dockerd on the default socket, with the
# containerd image store. Another engine there is stopped when told to (stop_foreign_engine).
start_current_engine() {
    local store version
    version="$(engine_answer "unix://${CURRENT_SOCK}" '{{.ServerVersion}}')"
    if [[ -n "$version" ]]; then
        store="$(engine_answer "unix://${CURRENT_SOCK}" '{{range .DriverStatus}}{{index . 0}}={{index . 1}} {{end}}')"
        if [[ "$version" == "${CURRENT_MAJOR}".* && "$store" == *"io.containerd.snapshotter.v1"* ]]; then
            log "current engine already running (docker $version, containerd image store)"
            return 0
        fi
        stop_foreign_engine "docker $version (${store:-no driver status})"
    fi
    mkdir -p "$CURRENT_DATA" "$CURRENT_RUN/containerd"
    local bin="${CURRENT_PREFIX}/bin" conf="${CURRENT_RUN}/containerd.toml"
    cat >"$conf" <<EOF
version = 2
root = "${CURRENT_DATA}/containerd"
state = "${CURRENT_RUN}/containerd/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "${CURRENT_CONTAINERD_SOCK}"
[plugins."io.containerd.internal.v1.opt"]
  path = "${CURRENT_DATA}/containerd-opt"
EOF
    stop_pid "${CURRENT_RUN}/containerd.pid"
    log "starting the current engine's containerd"
    PATH="$bin:$PATH" setsid "$bin/containerd" --config "$conf" </dev/null >/tmp/containerd-current.log 2>&1 9>&- &
    echo $! >"${CURRENT_RUN}/containerd.pid"
    local i
    for ((i = 0; i < 60; i++)); do
        [[ -S "$CURRENT_CONTAINERD_SOCK" ]] && break
        sleep 0.5
    done
    [[ -S "$CURRENT_CONTAINERD_SOCK" ]] || {
        tail -n 20 /tmp/containerd-current.log >&2 || true
        die "containerd made no socket at $CURRENT_CONTAINERD_SOCK within 30 s (log: /tmp/containerd-current.log)"
    }
    printf '{"features": {"containerd-snapshotter": true}}\n' >"${CURRENT_RUN}/daemon.json"
    # A stale netns mount of an engine that died would make the new one fail.
    umount "${CURRENT_RUN}/exec/netns/default" 2>/dev/null || true
    log "starting the current engine (dockerd ${CURRENT_MAJOR}.x, containerd image store) on $CURRENT_SOCK"
    PATH="$bin:$PATH" setsid "$bin/dockerd" --config-file "${CURRENT_RUN}/daemon.json" \
        --containerd "$CURRENT_CONTAINERD_SOCK" -H "unix://${CURRENT_SOCK}" \
        --data-root "${CURRENT_DATA}/docker" --exec-root "${CURRENT_RUN}/exec" \
        --pidfile "${CURRENT_RUN}/dockerd.pid" --bridge=none --iptables=false --ip-forward=false \
        --ip-masq=false </dev/null >/tmp/dockerd.log 2>&1 9>&- &
    wait_engine "unix://${CURRENT_SOCK}" /tmp/dockerd.log
    store="$(engine_answer "unix://${CURRENT_SOCK}" '{{range .DriverStatus}}{{index . 0}}={{index . 1}} {{end}}')"
    [[ "$store" == *"io.containerd.snapshotter.v1"* ]] ||
        die "the current engine started without the containerd image store (${store:-no driver status})"
}

start_engines() {
    start_legacy_engine
    start_current_engine
}

# legacy_bases IMAGE...: the legacy engine's own copy of each base, pulled from the base
# registry (each name is a two-arch list there; 20.10 takes its amd64 image).
legacy_bases() {
    local image
    for image in "$@"; do
        docker -H "$LEGACY_HOST" pull -q "$image" >/dev/null || die "legacy engine: docker pull $image failed"
        [[ "$(docker -H "$LEGACY_HOST" image inspect -f '{{.Architecture}}' "$image")" == amd64 ]] ||
            die "legacy engine: $image is not the amd64 image after pulling its list"
    done
    docker -H "$LEGACY_HOST" run --rm --network none "$2" sh -c 'python3.11 -c "import venv"' >/dev/null 2>&1 ||
        die "legacy engine: python3.11 does not run in $2"
    log "legacy engine has the bases"
}

# --------------------------------------------------------------------------
# podman (Debian 12's 4.3) serving the Docker API, as HPC sites run it: `podman system service`
# on a socket of its own (PODMAN_HOST), for tests/integration/test_podman.py. Its default
# nofile/nproc ulimits are refused in this sandbox (containers.conf: none), and it trusts the
# loopback registries over plain HTTP only when told (registries.conf.d).
# --------------------------------------------------------------------------
readonly PODMAN_RUN="/run/imagefactory-podman"
readonly PODMAN_SOCK="${PODMAN_RUN}/podman.sock"
readonly PODMAN_HOST="unix://${PODMAN_SOCK}"

configure_podman() {
    mkdir -p /etc/containers/registries.conf.d
    local conf=/etc/containers/containers.conf
    if ! grep -qs '^default_ulimits = \[\]' "$conf"; then
        [[ ! -s "$conf" ]] || die "$conf exists without 'default_ulimits = []' under [containers]: add it by hand"
        printf '[containers]\ndefault_ulimits = []\n' >"$conf"
    fi
    printf '[[registry]]\nlocation = "%s"\ninsecure = true\n\n[[registry]]\nlocation = "%s"\ninsecure = true\n' \
        "$1" "$2" >/etc/containers/registries.conf.d/50-imagefactory-ci.conf
}

start_podman_service() {
    configure_podman "$@"
    if [[ "$(engine_answer "$PODMAN_HOST" '{{.ServerVersion}}')" == 4.* ]]; then
        log "podman service already running ($PODMAN_HOST)"
        return 0
    fi
    mkdir -p "$PODMAN_RUN"
    rm -f "$PODMAN_SOCK"
    log "starting podman system service on $PODMAN_HOST"
    setsid podman system service --time=0 "$PODMAN_HOST" </dev/null >/tmp/podman-service.log 2>&1 9>&- &
    wait_engine "$PODMAN_HOST" /tmp/podman-service.log
}

# podman_bases IMAGE...: podman's own copy of each base, pulled from the base registry.
podman_bases() {
    local image
    for image in "$@"; do
        podman pull -q "$image" >/dev/null || die "podman pull $image failed"
    done
    podman run --rm --network none "${!#}" sh -c 'python3.11 -c "import venv"' >/dev/null 2>&1 ||
        die "podman: python3.11 does not run in ${!#}"
    log "podman has the bases"
}
