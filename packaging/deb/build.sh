#!/usr/bin/env bash
# Build the Debian package from the same files the installer uses.
#   packaging/deb/build.sh [OUT_DIR]
# VERSION defaults to <pyproject version>-1; the target distribution is appended
# (+deb12, +deb13, +ubuntu24.04: the one this runs on, whose python3 the venv is built
# with) unless VERSION already names one. DEBFULLNAME and DEBEMAIL name the maintainer
# (default: the project's own address below).
#
# Reproducible: the same commit gives the same package contents. Every timestamp is the
# commit's (SOURCE_DATE_EPOCH: file mtimes in the archive, the changelog, the manual
# pages), the venv comes from requirements.lock's hashes, no bytecode is shipped (a
# .pyc embeds its build; postinst compiles on the target), and nothing records where
# the build ran (staging paths, the source checkout's path).
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$src/dist}
SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git -C "$src" log -1 --format=%ct 2>/dev/null ||
                                         stat -c %Y "$src/pyproject.toml")}
export SOURCE_DATE_EPOCH
maintainer="${DEBFULLNAME:-qvld maintainers} <${DEBEMAIL:-maintainers@users.noreply.a-seed-c4f83569.example}>"
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
# dh-virtualenv's layout: one venv per package under /opt/venvs.
venv=/opt/venvs/qvld

# The virtualenv, built in the staging tree and then moved in place: only its scripts'
# shebangs name the staging path.
# Exactly the versions requirements.lock pins, each checked against its hash (the same
# resolution on every build), then qvld itself, then what a service does not need.
"$python" -m venv "$root$venv"
pip=("$root$venv/bin/python" -m pip --quiet --disable-pip-version-check)
"${pip[@]}" install --no-deps --no-compile --require-hashes -r "$src/requirements.lock"
# qvld from a wheel built here (installed from the checkout, pip would record its path),
# with the pinned build backend (packaging/build-requirements.lock).
"${pip[@]}" install --no-deps --no-compile --require-hashes \
  -r "$src/packaging/build-requirements.lock"
"${pip[@]}" wheel --no-deps --no-build-isolation --wheel-dir "$work/wheel" "$src" >/dev/null
"${pip[@]}" install --no-deps --no-compile "$work"/wheel/qvld-*.whl
"$src/packaging/prune-venv.sh" "$root$venv"
"${pip[@]}" uninstall -y pip setuptools wheel >/dev/null 2>&1 || true
# Shared libraries are loaded, never executed: not executable (Debian policy 8.1).
find "$root$venv" -type f -name '*.so*' -exec chmod 0644 {} +
grep -rlI --null "$root$venv" "$root$venv/bin" "$root$venv/pyvenv.cfg" |
  xargs -0 -r sed -i "s|$root$venv|$venv|g"
find "$root$venv" -name __pycache__ -type d -prune -exec rm -rf {} +
find "$root$venv" -name direct_url.json -path '*.dist-info/*' -delete
# pip's RECORD files name each installed file's hash: the scripts' were taken before
# their shebangs were rewritten above, and direct_url.json is gone.
"$python" "$src/packaging/deb/fix-records.py" "$root$venv"

install -d "$root/usr/bin"
ln -s "$venv/bin/qvld" "$root/usr/bin/qvld"
ln -s "$venv/bin/qvlctl" "$root/usr/bin/qvlctl"
install -D -m 0644 "$src/packaging/systemd/qvld.service" "$root/lib/systemd/system/qvld.service"
install -D -m 0644 "$src/packaging/systemd/qvld.socket" "$root/lib/systemd/system/qvld.socket"
install -D -m 0644 "$src/packaging/systemd/qvld-http.socket" \
  "$root/lib/systemd/system/qvld-http.socket"
for unit in qvld@.service qvld@.socket; do
  install -D -m 0644 "$src/packaging/systemd/$unit" "$root/lib/systemd/system/$unit"
done
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
printf 'Copyright 2026 the qvld developers.\nqvld is licensed under the Apache License 2.0.\nOn Debian systems, see /usr/share/common-licenses/Apache-2.0.\nThe bundled Python packages under %s carry their own licenses.\n' "$venv" > "$doc/copyright"
printf 'qvld (%s) unstable; urgency=medium\n\n  * Package built from the qvld source tree.\n\n -- %s  %s\n' \
  "$version" "$maintainer" "$(date -R -u -d "@$SOURCE_DATE_EPOCH")" |
  gzip -9n > "$doc/changelog.Debian.gz"

install -d "$root/DEBIAN"
# As dpkg-gencontrol counts it (KiB per file, rounded up; 1 per directory and link):
# independent of the file system the build ran on.
size=$(find "$root" -mindepth 1 -printf '%y %s\n' |
       awk '$1 == "f" { kib += int(($2 + 1023) / 1024); next } { kib += 1 } END { print kib }')
cat > "$root/DEBIAN/control" <<CONTROL
Package: qvld
Version: $version
Architecture: $(dpkg --print-architecture)
Maintainer: $maintainer
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
# What debsums and dpkg --verify check the installed files against.
(cd "$root" && find . -type f ! -path './DEBIAN/*' -printf '%P\0' | LC_ALL=C sort -z |
   xargs -0 md5sum) > "$root/DEBIAN/md5sums"
chmod 0644 "$root/DEBIAN/md5sums"
for script in postinst prerm postrm; do
  install -m 0755 "$src/packaging/deb/$script" "$root/DEBIAN/$script"
done
mkdir -p "$out"
dpkg-deb --root-owner-group -Zgzip -z3 --build "$root" "$out/qvld_${version}_$(dpkg --print-architecture).deb" >/dev/null
echo "$out/qvld_${version}_$(dpkg --print-architecture).deb"
