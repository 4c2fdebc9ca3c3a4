# Images without a public registry, shared by scripts/cluster and scripts/demo (sourced).
#
# A Debian base made with mmdebstrap from Debian's packages, cached as a tar under a key of
# everything that went into it, then JupyterHub's base and a minimal notebook image
# (jupyterhub-singleuser) built on it from compose/local/. Nothing is pulled from Docker Hub
# or quay.io. The cache folder is the checkout's .images/ (SWARM_GPU_IMAGE_CACHE overrides),
# so the demo and the three-node cluster build the base once between them.
#
# The caller defines: log MESSAGE, die MESSAGE [LOGFILE], need COMMAND PACKAGE, and
# images_docker DOCKER-ARGS... (the docker CLI against the engine the images go into).

IMAGES_REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
IMAGE_CACHE=${SWARM_GPU_IMAGE_CACHE:-$IMAGES_REPO_ROOT/.images}
DEBIAN_SUITE=bookworm
DEBIAN_MIRROR=${SWARM_GPU_DEBIAN_MIRROR:-http://deb.debian.org/debian}
BASE_PACKAGES=python3,python3-venv,python3-pip,ca-certificates,sqlite3
# The host reaches apt, PyPI and npm through whatever CA its bundle trusts (a site's TLS
# proxy included): the images trust the same bundle.
HOST_CA=/etc/ssl/certs/ca-certificates.crt

base_key() {
    {
        mmdebstrap --version
        echo "$DEBIAN_SUITE $DEBIAN_MIRROR $BASE_PACKAGES"
        sha256sum <"$HOST_CA"
        declare -f make_base
    } | sha256sum | cut -c1-16
}

make_base() { # OUTPUT.tar
    mmdebstrap --quiet --format=tar --variant=minbase --include="$BASE_PACKAGES" \
        --customize-hook="cp '$HOST_CA' \"\$1/usr/local/share/ca-certificates/host-bundle.crt\"" \
        --customize-hook='chroot "$1" update-ca-certificates' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
        "$DEBIAN_SUITE" "$1" "$DEBIAN_MIRROR"
}

BASE_IMAGE=
# Sets BASE_IMAGE to the Debian base in the engine, made (and cached) first if missing.
# An interrupted mmdebstrap leaves only a .tmp file, which the next run starts again.
build_base() {
    need mmdebstrap mmdebstrap
    local key tar
    key=$(base_key)
    BASE_IMAGE=swarm-gpu/debian-base:$key
    tar=$IMAGE_CACHE/debian-base-$key.tar
    if [[ ! -f $tar ]]; then
        mkdir -p "$IMAGE_CACHE"
        rm -f "$IMAGE_CACHE"/debian-base-*.tar "$IMAGE_CACHE"/debian-base-*.tar.tmp # older keys
        log "mmdebstrap $DEBIAN_SUITE ($BASE_PACKAGES) -> $tar"
        make_base "$tar.tmp" || die "mmdebstrap failed"
        mv "$tar.tmp" "$tar"
    fi
    if ! images_docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
        images_docker import \
            --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            --change "ENV PIP_CERT=$HOST_CA SSL_CERT_FILE=$HOST_CA" \
            --change 'CMD ["bash"]' "$tar" "$BASE_IMAGE" >/dev/null || die "docker import failed"
    fi
}

build_image() { # TAG DOCKERFILE CONTEXT [build args...]
    local tag=$1 dockerfile=$2 context=$3 logfile
    shift 3
    mkdir -p "$IMAGE_CACHE"
    logfile=$IMAGE_CACHE/build-$(basename "$dockerfile")-${tag//[^A-Za-z0-9]/_}.log
    # --network host: the build reaches apt and PyPI as the host does (no bridge here).
    if ! images_docker build --network host -f "$dockerfile" -t "$tag" "$@" "$context" \
        >"$logfile" 2>&1 </dev/null; then
        die "docker build $tag failed" "$logfile"
    fi
}

# JupyterHub's base (hub stage's HUB_BASE) on BASE_IMAGE; prints its tag.
hub_base_tag() { echo "swarm-gpu/jupyterhub-base:${BASE_IMAGE##*:}"; }
build_hub_base() {
    build_image "$(hub_base_tag)" "$IMAGES_REPO_ROOT/compose/local/jupyterhub.Dockerfile" \
        "$IMAGES_REPO_ROOT/compose/local" --build-arg "DEBIAN_BASE=$BASE_IMAGE"
}

build_notebook() { # TAG: the minimal notebook image on the JupyterHub base
    build_image "$1" "$IMAGES_REPO_ROOT/compose/local/notebook.Dockerfile" \
        "$IMAGES_REPO_ROOT/compose/local" --build-arg "JUPYTERHUB_BASE=$(hub_base_tag)"
}
