# The installed /etc/qvld/qvld.yaml: the documented defaults (etc/qvld/qvld.yaml) with
# the service's own directories filled in. Used by packaging/install.sh and the .deb.
s|^  path: ~ |  path: /var/lib/qvld/models/qwen3-vl-2b |
s|^  cache_dir: ~  |  cache_dir: /var/cache/qvld|
