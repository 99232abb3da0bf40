#!/usr/bin/env bash
# Install qvld as a system service, or remove it.
#
#   packaging/install.sh [--destdir DIR] [--python PYTHON]       install (idempotent)
#   packaging/install.sh --uninstall [--purge] [--destdir DIR]   remove what install put
#
# Layout: a virtualenv in /opt/venvs/qvld (dh-virtualenv's layout, as in the .deb); /usr/bin/qvld and /usr/bin/qvlctl link into it
# (the path the unit's ExecStart names, as in the .deb); units, sysusers.d and
# tmpfiles.d files under /usr/lib; the config in /etc/qvld/qvld.yaml (an edited config
# is never overwritten: the new default goes beside it as qvld.yaml.dist). Models go in
# /var/lib/qvld/models, the compiled-model cache in /var/cache/qvld; --uninstall keeps
# both and the config unless --purge is given.
set -euo pipefail

src=$(cd "$(dirname "$0")/.." && pwd)
destdir=""
# The system interpreter by default: the venv's python must stay reachable under the
# unit's ProtectHome= (a pyenv or conda under /root or /home would not be).
python=${PYTHON:-$( [ -x /usr/bin/python3 ] && echo /usr/bin/python3 || echo python3 )}
action=install
purge=no
while [ $# -gt 0 ]; do
  case "$1" in
    --destdir) destdir=${2%/}; shift 2 ;;
    --python) python=$2; shift 2 ;;
    --uninstall) action=uninstall; shift ;;
    --purge) purge=yes; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

venv=/opt/venvs/qvld
units=/usr/lib/systemd/system
files=(
  "$units/qvld.service" "$units/qvld.socket" "$units/qvld-http.socket"
  "$units/qvld@.service" "$units/qvld@.socket"
  /usr/lib/sysusers.d/qvld.conf /usr/lib/tmpfiles.d/qvld.conf
  /usr/bin/qvld /usr/bin/qvlctl /usr/share/doc/qvld/README.md
  /usr/share/qvld/prometheus/qvld-alerts.yml /usr/share/qvld/prometheus/qvld-alerts.test.yml
  /usr/share/qvld/grafana/qvld-dashboard.json /usr/share/qvld/systemd/remote-metrics.conf
  /usr/share/man/man8/qvld.8 /usr/share/man/man1/qvlctl.1 /usr/share/man/man5/qvld.yaml.5
  /usr/share/bash-completion/completions/qvld /usr/share/bash-completion/completions/qvlctl
  /usr/share/zsh/vendor-completions/_qvld /usr/share/zsh/vendor-completions/_qvlctl
)

systemd_running() { [ -z "$destdir" ] && [ -d /run/systemd/system ]; }

install_file() {  # mode source target
  install -D -m "$1" "$2" "$destdir$3"
}

do_install() {
  # The virtualenv: created once, then qvld (and what it needs) installed into it.
  if [ ! -x "$destdir$venv/bin/python" ]; then
    "$python" -m venv "$destdir$venv"
  fi
  # Exactly what requirements.lock pins (hash-checked), qvld, then the venv pruned of
  # what a service does not need (packaging/prune-venv.sh).
  "$destdir$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    --no-deps --require-hashes -r "$src/requirements.lock"
  "$destdir$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    --no-deps --upgrade "$src"
  "$src/packaging/prune-venv.sh" "$destdir$venv"
  # Bytecode now: the service cannot write it later (ProtectSystem=strict).
  "$destdir$venv/bin/python" -m compileall -q -j 0 ${destdir:+-s "$destdir" -p /} \
    "$destdir$venv/lib" >/dev/null || true
  rm -rf "$destdir/opt/qvld"  # where earlier installers put the venv
  mkdir -p "$destdir/usr/bin"
  ln -sfn "$venv/bin/qvld" "$destdir/usr/bin/qvld"
  ln -sfn "$venv/bin/qvlctl" "$destdir/usr/bin/qvlctl"

  install_file 0644 "$src/packaging/systemd/qvld.service" "$units/qvld.service"
  install_file 0644 "$src/packaging/systemd/qvld.socket" "$units/qvld.socket"
  install_file 0644 "$src/packaging/systemd/qvld-http.socket" "$units/qvld-http.socket"
  install_file 0644 "$src/packaging/systemd/qvld@.service" "$units/qvld@.service"
  install_file 0644 "$src/packaging/systemd/qvld@.socket" "$units/qvld@.socket"
  install_file 0644 "$src/packaging/sysusers.d/qvld.conf" /usr/lib/sysusers.d/qvld.conf
  install_file 0644 "$src/packaging/tmpfiles.d/qvld.conf" /usr/lib/tmpfiles.d/qvld.conf
  install_file 0644 "$src/README.md" /usr/share/doc/qvld/README.md
  # For the operator to copy: alert rules (with their promtool tests), the dashboard,
  # and the drop-in that lets a remote Prometheus scrape.
  local shared
  for shared in prometheus/qvld-alerts.yml prometheus/qvld-alerts.test.yml \
      grafana/qvld-dashboard.json systemd/remote-metrics.conf; do
    install_file 0644 "$src/packaging/$shared" "/usr/share/qvld/$shared"
  done
  # Manual pages and completion, generated from the parsers and the config schema with
  # build-time tools kept out of the service's virtualenv.
  local docs
  docs=$(mktemp -d)
  "$destdir$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    --target "$docs/lib" -r "$src/packaging/docs-requirements.txt"
  PYTHONPATH="$docs/lib" "$destdir$venv/bin/python" "$src/tools/gen_docs.py" "$docs/out" \
    >/dev/null
  install_file 0644 "$docs/out/man/qvld.8" /usr/share/man/man8/qvld.8
  install_file 0644 "$docs/out/man/qvlctl.1" /usr/share/man/man1/qvlctl.1
  install_file 0644 "$docs/out/man/qvld.yaml.5" /usr/share/man/man5/qvld.yaml.5
  local name
  for name in qvld qvlctl; do
    install_file 0644 "$docs/out/completion/$name" "/usr/share/bash-completion/completions/$name"
    install_file 0644 "$docs/out/completion/_$name" "/usr/share/zsh/vendor-completions/_$name"
  done
  rm -rf "$docs"

  # The config (see service-config.sed).
  local dist
  dist=$(mktemp)
  sed -f "$src/packaging/service-config.sed" "$src/etc/qvld/qvld.yaml" > "$dist"
  local config="$destdir/etc/qvld/qvld.yaml"
  if [ ! -e "$config" ]; then
    install -D -m 0644 "$dist" "$config"
  elif ! cmp -s "$dist" "$config"; then
    install -D -m 0644 "$dist" "$config.dist"
    echo "install.sh: kept your edited $config; the new default is $config.dist" >&2
  else
    rm -f "$config.dist"
  fi
  rm -f "$dist"

  # The user and the state directories belong to the machine that runs qvld: a staged
  # tree (--destdir, for a package) holds no /etc/passwd to add them to; that machine's
  # systemd-sysusers and systemd-tmpfiles make them from the files installed above.
  if [ -z "$destdir" ] && command -v systemd-sysusers >/dev/null; then
    systemd-sysusers /usr/lib/sysusers.d/qvld.conf
  fi
  if [ -z "$destdir" ] && command -v systemd-tmpfiles >/dev/null; then
    systemd-tmpfiles --create /usr/lib/tmpfiles.d/qvld.conf
  fi
  if systemd_running; then
    systemctl daemon-reload
    echo "installed; start with: systemctl enable --now qvld.socket (set model.path in" \
         "/etc/qvld/qvld.yaml first)" >&2
  fi
}

do_uninstall() {
  if systemd_running; then
    systemctl disable --now qvld.socket qvld-http.socket qvld.service 2>/dev/null || true
    systemctl stop 'qvld@*.service' 'qvld@*.socket' 2>/dev/null || true
  fi
  for f in "${files[@]}"; do
    rm -f "$destdir$f"
  done
  # the links of instances the admin enabled (systemctl enable qvld@0.service)
  find "$destdir/etc/systemd/system" -name 'qvld@*' -type l -delete 2>/dev/null || true
  rmdir "$destdir/usr/share/doc/qvld" 2>/dev/null || true
  rmdir "$destdir"/usr/share/qvld/* "$destdir/usr/share/qvld" 2>/dev/null || true
  rm -rf "$destdir$venv" "$destdir/opt/qvld"
  rmdir "$destdir/opt/venvs" 2>/dev/null || true
  rm -f "$destdir/etc/qvld/qvld.yaml.dist"
  if [ "$purge" = yes ]; then
    rm -rf "$destdir/etc/qvld" "$destdir/var/lib/qvld" "$destdir/var/cache/qvld"
  fi
  if systemd_running; then
    systemctl daemon-reload
  fi
}

"do_$action"
