# Sourced by train.sh and test.sh: `quiet_pip ARGS...` is `pip install -q ARGS...`
# without pip's warning about running as root (a container's usual user); on failure
# everything pip said is shown and the calling script stops.
quiet_pip() {
    local said
    if ! said=$(PIP_ROOT_USER_ACTION=ignore python -m pip install -q "$@" 2>&1); then
        printf '%s\n' "$said" >&2
        return 1
    fi
    printf '%s\n' "$said" | grep -v -e "Running pip as the 'root' user" -e '^$' || true
}
