# Sourced by train.sh and test.sh.
#   quiet_pip ARGS...  pip install -q ARGS..., without pip's warning about running as root
#                      (a container's usual user); on failure everything pip said is shown
#                      and the calling script stops.
#   torch_decision     one line: "keep VERSION" (a supported torch is installed),
#                      "install" (no torch) or "unsupported VERSION"; installs nothing.
#   ensure_torch       acts on torch_decision: keeps a supported torch (a CUDA build stays
#                      a CUDA build), installs torch 2.13.0 only where none is installed
#                      (and says so), stops on an unsupported one with the fix.
# The supported range is the one pyproject.toml declares and CI runs (docs/installation.md).
TORCH_MIN="2.11"      # inclusive
TORCH_BELOW="2.14"    # exclusive
TORCH_PIN="2.13.0"    # what a machine without torch gets

quiet_pip() {
    local said
    if ! said=$(PIP_ROOT_USER_ACTION=ignore python -m pip install -q "$@" 2>&1); then
        printf '%s\n' "$said" >&2
        return 1
    fi
    printf '%s\n' "$said" | grep -v -e "Running pip as the 'root' user" -e '^$' || true
}

torch_decision() {
    # Import torch (not its pip metadata): a torch built from source or installed by conda
    # has a version all the same. Local labels (+cu128, +cpu) and pre-releases are kept
    # out of the comparison: 2.12.0+cu128 is 2.12.
    python - "$TORCH_MIN" "$TORCH_BELOW" <<'PY'
import re
import sys

def release(text):
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:2])

try:
    import torch
except ImportError:
    print("install")
    sys.exit(0)
version = str(getattr(torch, "__version__", "0"))
low, high = release(sys.argv[1]), release(sys.argv[2])
print(("keep " if low <= release(version) < high else "unsupported ") + version)
PY
}

ensure_torch() {
    local decision index_args=()
    decision=$(torch_decision)
    case "$decision" in
        keep\ *)
            echo "[setup] keeping the installed torch ${decision#keep } (supported: ${TORCH_MIN} <= torch < ${TORCH_BELOW})"
            ;;
        install)
            # No GPU driver: the CPU-only wheel (the PyTorch index; a local build such as
            # 2.13.0+cpu outranks PyPI's 2.13.0 when both are reachable). A GPU: PyPI's
            # default Linux wheel, which is a CUDA build. SIMPLEFSDP_TORCH_INDEX picks
            # another index (e.g. https://download.pytorch.org/whl/cu128).
            if [[ -n "${SIMPLEFSDP_TORCH_INDEX:-}" ]]; then
                index_args=(--extra-index-url "$SIMPLEFSDP_TORCH_INDEX")
            elif ! command -v nvidia-smi >/dev/null 2>&1; then
                index_args=(--extra-index-url https://download.pytorch.org/whl/cpu)
            fi
            echo "[setup] no torch installed: installing torch==${TORCH_PIN} ${index_args[*]}"
            quiet_pip "torch==${TORCH_PIN}" "${index_args[@]}"
            ;;
        *)
            echo "[setup] torch ${decision#unsupported } is installed, but simplefsdp supports ${TORCH_MIN} <= torch < ${TORCH_BELOW}." >&2
            echo "[setup] Nothing was changed. Install a supported torch (e.g. pip install torch==${TORCH_PIN}) or use a virtual environment." >&2
            return 1
            ;;
    esac
}
