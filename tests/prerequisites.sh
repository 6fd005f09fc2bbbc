# Sourced by demo.sh and .ci/run: the prerequisites Debian packages.
#
#   need_debian_packages PROGRAM=PACKAGE...
#
# For each PROGRAM not on PATH, its PACKAGE is needed. As root on a
# Debian-like system (apt-get present), they are installed with apt-get,
# saying so; otherwise this stops with the exact command to run. The Rust
# tests do the same (tests/support/process.rs, require_debian_program).
# LANEKEEPER_NO_INSTALL=1 never installs (it only names the command).

need_debian_packages() {
  local pair missing=()
  for pair in "$@"; do
    if ! command -v "${pair%%=*}" >/dev/null 2>&1; then
      case " ${missing[*]} " in *" ${pair#*=} "*) ;; *) missing+=("${pair#*=}") ;; esac
    fi
  done
  [ "${#missing[@]}" -eq 0 ] && return 0
  local install="apt-get install -y ${missing[*]}"
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && [ -z "${LANEKEEPER_NO_INSTALL:-}" ]; then
    echo "==> ${missing[*]} not installed: installing with 'apt-get update && $install' (root on a Debian-like system)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq -o DPkg::Lock::Timeout=300 "${missing[@]}" >/dev/null
    # lanekeeper starts its own redis-server on a free port; the distro's service is not needed.
    (service redis-server stop >/dev/null 2>&1 || true)
    return 0
  fi
  local sudo="sudo "
  [ "$(id -u)" = 0 ] && sudo=""
  if command -v apt-get >/dev/null 2>&1; then
    echo "error: ${missing[*]} not installed; install with: ${sudo}apt-get update && ${sudo}$install" >&2
  else
    echo "error: ${missing[*]} not installed; install them with your package manager (on Debian or Ubuntu: ${sudo}$install)" >&2
  fi
  return 1
}
