# The checkout's own Python, shared by scripts/test and scripts/demo (sourced, not run).
#
# project_python prints the interpreter to use: $PYTHON when set, else the virtual
# environment $SWARM_GPU_VENV (default: .venv/ in the checkout), made with
# `python3 -m venv` when it does not exist yet. Installing into a venv of the checkout keeps
# two checkouts on one machine apart: an editable install into the machine's interpreter
# would make every checkout import the last one installed.

project_python() {
    if [[ -n ${PYTHON:-} ]]; then
        printf '%s\n' "$PYTHON"
        return 0
    fi
    local venv=${SWARM_GPU_VENV:-$REPO_ROOT/.venv}
    if [[ ! -x $venv/bin/python ]]; then
        printf '[venv] creating %s (python3 -m venv)\n' "$venv" >&2
        if ! python3 -m venv "$venv" >&2; then
            # Debian ships venv's pip bootstrap separately.
            rm -rf "$venv"
            printf '[venv] python3 -m venv failed; installing python3-venv\n' >&2
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
                python3-venv </dev/null >&2 || return 1
            python3 -m venv "$venv" >&2 || return 1
        fi
    fi
    printf '%s\n' "$venv/bin/python"
}
