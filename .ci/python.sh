# Sourced by .ci/run and .ci/checks.

# The bin folder of the newest installed pyenv Python $1.x.
python_bin() {
    local found
    found=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}/versions/$1".*/bin 2>/dev/null | sort -V | tail -n 1)
    if [[ -z $found ]]; then
        echo "no Python $1 under ${PYENV_ROOT:-$HOME/.pyenv}/versions" >&2
        return 1
    fi
    echo "$found"
}
