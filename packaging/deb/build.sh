#!/usr/bin/env bash
# Build the Debian package from the same files the installer uses.
#   packaging/deb/build.sh [OUT_DIR]
# VERSION defaults to <pyproject version>-1; the target distribution is appended
# (+deb12, +deb13, +ubuntu24.04: the one this runs on, whose python3 the venv is built
# with) unless VERSION already names one.
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$src/dist}
upstream=$(sed -n 's/^version = "\(.*\)"/\1/p' "$src/pyproject.toml")
python=/usr/bin/python3
# (in a subshell: os-release sets VERSION too)
target=$(. /etc/os-release; case $ID in debian) echo "deb${VERSION_ID%%.*}" ;;
                                        *) echo "$ID$VERSION_ID" ;; esac)
version=${VERSION:-$upstream-1}
case $version in *+*) ;; *) version=$version+$target ;; esac
# The venv runs on exactly this python3 minor version: Depends says so.
pyminor=$("$python" -c 'import sys; print(sys.version_info[1])')
pymajor=$("$python" -c 'import sys; print(sys.version_info[0])')
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root=$work/root
venv=/opt/qvld/venv

# The virtualenv, built in the staging tree and then moved in place: only its scripts'
# shebangs name the staging path.
# Exactly the versions requirements.lock pins, each checked against its hash (the same
# resolution on every build), then qvld itself, then what a service does not need.
"$python" -m venv "$root$venv"
"$root$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps \
  --require-hashes -r "$src/requirements.lock"
"$root$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "$src"
"$src/packaging/prune-venv.sh" "$root$venv"
"$root$venv/bin/python" -m pip uninstall --quiet -y pip setuptools wheel >/dev/null 2>&1 || true
# Shared libraries are loaded, never executed: not executable (Debian policy 8.1).
find "$root$venv" -type f -name '*.so*' -exec chmod 0644 {} +
grep -rlI --null "$root$venv" "$root$venv/bin" "$root$venv/pyvenv.cfg" |
  xargs -0 -r sed -i "s|$root$venv|$venv|g"
find "$root$venv" -name __pycache__ -type d -prune -exec rm -rf {} +

install -d "$root/usr/bin"
ln -s "$venv/bin/qvld" "$root/usr/bin/qvld"
ln -s "$venv/bin/qvlctl" "$root/usr/bin/qvlctl"
install -D -m 0644 "$src/packaging/systemd/qvld.service" "$root/lib/systemd/system/qvld.service"
install -D -m 0644 "$src/packaging/systemd/qvld.socket" "$root/lib/systemd/system/qvld.socket"
install -D -m 0644 "$src/packaging/systemd/qvld-http.socket" \
  "$root/lib/systemd/system/qvld-http.socket"
install -D -m 0644 "$src/packaging/sysusers.d/qvld.conf" "$root/usr/lib/sysusers.d/qvld.conf"
install -D -m 0644 "$src/packaging/tmpfiles.d/qvld.conf" "$root/usr/lib/tmpfiles.d/qvld.conf"
install -d "$root/etc/qvld"
sed -f "$src/packaging/service-config.sed" "$src/etc/qvld/qvld.yaml" \
  > "$root/etc/qvld/qvld.yaml"
chmod 0644 "$root/etc/qvld/qvld.yaml"
for shared in prometheus/qvld-alerts.yml prometheus/qvld-alerts.test.yml \
    grafana/qvld-dashboard.json systemd/remote-metrics.conf; do
  install -D -m 0644 "$src/packaging/$shared" "$root/usr/share/qvld/$shared"
done
# Manual pages (compressed, as Debian's policy asks) and completion, generated with
# build-time tools kept out of the package's virtualenv.
# (The package's venv has no pip left, and must not gain __pycache__ from this run.)
"$python" -m venv "$work/docs-venv"
"$work/docs-venv/bin/pip" install --quiet --disable-pip-version-check \
  --target "$work/docs-lib" -r "$src/packaging/docs-requirements.txt"
PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$work/docs-lib" "$root$venv/bin/python" \
  "$src/tools/gen_docs.py" "$work/docs" >/dev/null
for page in qvld.8 qvlctl.1 qvld.yaml.5; do
  install -D -m 0644 "$work/docs/man/$page" "$root/usr/share/man/man${page##*.}/$page"
  gzip -9n "$root/usr/share/man/man${page##*.}/$page"
done
for name in qvld qvlctl; do
  install -D -m 0644 "$work/docs/completion/$name" \
    "$root/usr/share/bash-completion/completions/$name"
  install -D -m 0644 "$work/docs/completion/_$name" "$root/usr/share/zsh/vendor-completions/_$name"
done
install -D -m 0644 "$src/packaging/deb/lintian-overrides" \
  "$root/usr/share/lintian/overrides/qvld"
doc=$root/usr/share/doc/qvld
install -D -m 0644 "$src/README.md" "$doc/README.md"
printf 'Copyright 2026 the qvld developers.\nqvld is licensed under the Apache License 2.0.\nOn Debian systems, see /usr/share/common-licenses/Apache-2.0.\nThe bundled Python packages under /opt/qvld/venv carry their own licenses.\n' > "$doc/copyright"
printf 'qvld (%s) unstable; urgency=medium\n\n  * Package built from the qvld source tree.\n\n -- qvld developers <qvld@localhost>  %s\n' \
  "$version" "$(date -R)" | gzip -9n > "$doc/changelog.Debian.gz"

install -d "$root/DEBIAN"
size=$(du -sk "$root" | cut -f1)
cat > "$root/DEBIAN/control" <<CONTROL
Package: qvld
Version: $version
Architecture: $(dpkg --print-architecture)
Maintainer: qvld developers <qvld@localhost>
Installed-Size: $size
Depends: python3 (>= $pymajor.$pyminor), python3 (<< $pymajor.$((pyminor + 1))), libc6 (>= 2.28), systemd, init-system-helpers (>= 1.54)
Section: misc
Priority: optional
Homepage: https://example.invalid/qvld
Description: vision-language daemon for plain CPUs (Qwen3-VL on OpenVINO)
 qvld answers questions about images with Qwen3-VL on CPUs through OpenVINO,
 serving msgpack frames over a Unix socket, with Prometheus metrics, preflight
 checks and the qvlctl client. Managed by systemd (socket activation).
CONTROL
echo /etc/qvld/qvld.yaml > "$root/DEBIAN/conffiles"
for script in postinst prerm postrm; do
  install -m 0755 "$src/packaging/deb/$script" "$root/DEBIAN/$script"
done
mkdir -p "$out"
dpkg-deb --root-owner-group -Zgzip -z3 --build "$root" "$out/qvld_${version}_$(dpkg --print-architecture).deb" >/dev/null
echo "$out/qvld_${version}_$(dpkg --print-architecture).deb"
