"""`qvld`: run the daemon in the foreground, or check its configuration."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from qvld import __version__, protocol
from qvld.config import Config, ConfigError
from qvld.config_loading import default_config_path, instance_source, load_config

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_CONFIG = 0, 1, 2, 78


def enable_crash_traces() -> None:
    """Make a native crash leave a line in the journal.

    SIGSEGV, SIGFPE, SIGABRT, SIGBUS or SIGILL inside OpenVINO kills the process before
    logging can say anything (systemd then only records the signal, restart after
    restart); faulthandler writes "Fatal Python error: ..." and every thread's Python
    stack to stderr first, async-signal-safely. The original stderr if it was replaced
    by something without a file descriptor.
    """
    for stream in (sys.stderr, sys.__stderr__):
        if stream is None:
            continue
        try:
            faulthandler.enable(file=stream, all_threads=True)
            return
        except (AttributeError, ValueError, OSError):  # no fileno(): e.g. captured output
            continue


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qvld",
        description="Qwen3-VL vision-language daemon (foreground, logs to stderr).",
        epilog="exit codes: 0 ok, 1 runtime failure, 2 usage, 78 configuration or model "
               "directory invalid",
    )
    parser.add_argument("command", nargs="?", default="run",
                        choices=["run", "check-config", "preflight", "api-key"],
                        help="run (default), check-config, preflight (system checks), or "
                             "api-key NAME (a new HTTP API key)")
    parser.add_argument("name", nargs="?", metavar="NAME",
                        help="api-key: the user the new key is for")
    parser.add_argument("--config", type=Path,
                        help="YAML config (default: $QVLD_CONFIG, else /etc/qvld/qvld.yaml "
                             "if it exists, else built-in defaults)")
    parser.add_argument("--model", type=Path,
                        help="model directory (= --set model.path=DIR), or the name of "
                             "one `qvlctl model pull` fetched (qwen3-vl-2b, ORG/NAME)")
    parser.add_argument("--socket", type=Path, help="socket path (= --set server.socket=P)")
    parser.add_argument("--instance", metavar="NAME",
                        help="run as instance NAME of the template units (qvld@NAME): "
                             "NAME.yaml beside the config file, or for a NUMA node number "
                             "the shared file bound to that node, its ports moved up by it")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a config key, e.g. engine.threads=4")
    parser.add_argument("--json", action="store_true", help="preflight: print JSON")
    parser.add_argument("--textfile", type=Path,
                        help="preflight: also write node_exporter textfile metrics here")
    parser.add_argument("--keys-file", type=Path, metavar="FILE",
                        help="api-key: append the key's hash to this file "
                             "(http.api_keys_file)")
    parser.add_argument("--replace", action="store_true",
                        help="api-key: revoke NAME's key and issue a new one in one write")
    parser.add_argument("--revoke", action="store_true",
                        help="api-key: revoke NAME's key (kept in the file as a comment)")
    parser.add_argument("--version", action="version", version=f"qvld {__version__}")
    return parser


def model_path(model: Path) -> Path:
    """--model: a directory, or the name of a model `qvlctl model pull` put under the
    models directory (qwen3-vl-2b, ORG/NAME, or the directory's own name)."""
    if model.exists():
        return model
    from qvld.modeltools.pull import pulled

    return pulled(str(model)) or model


def config_source(args: argparse.Namespace) -> tuple[Path | None, list[str]]:
    """The config file and the overrides, as a reload re-reads them."""
    overrides = list(args.overrides)
    if args.model is not None:
        overrides.append(f"model.path={model_path(args.model)}")
    if args.socket is not None:
        overrides.append(f"server.socket={args.socket}")
    path = args.config if args.config is not None else default_config_path()
    if args.instance is not None:
        return instance_source(path, overrides, args.instance)
    return path, overrides


def check_config(config: Config) -> int:
    from qvld.engine.model.model_dir import load_model_spec, processor_settings, resolve_backend
    from qvld.errors import ModelInvalid
    from qvld.http.callers import HttpSetupError, load_http

    try:
        load_http(config.http)  # the keys file and the fetch allow-lists
    except HttpSetupError as exc:
        for line in exc.errors:
            print(f"qvld: {line}", file=sys.stderr)
        return EXIT_CONFIG
    if config.model.path is None:
        print("qvld: configuration is valid, but model.path is not set", file=sys.stderr)
        return EXIT_CONFIG
    backend, why = resolve_backend(config.model)
    try:
        spec = load_model_spec(config.model.path, backend)
    except ModelInvalid as exc:
        print(f"qvld: model: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    for deprecation in config.deprecations():
        print(f"qvld: warning: {deprecation}", file=sys.stderr)
    print(f"configuration is valid; model {spec.name} at {spec.path}")
    print(f"runtime: {backend} ({why})")
    print("pictures and clips are processed with:")
    for key, value, source in processor_settings(spec.path):
        print(f"  {key:<28} {value!s:<20} from {source}")
    return EXIT_OK


def preflight(config: Config, as_json: bool, textfile: Path | None) -> int:
    from qvld import preflight as checks
    from qvld import tuning

    results = checks.run_checks(config)
    plan = [a.to_dict() for a in tuning.dry_run(config)]
    document = checks.report(results, plan)
    if textfile is not None:
        tmp = textfile.with_suffix(textfile.suffix + ".tmp")
        tmp.write_text(checks.textfile(results))
        tmp.replace(textfile)  # node_exporter must never read a half-written file
    if as_json:
        print(json.dumps(document, indent=2))
    else:
        print("\n".join(protocol.preflight_lines(document)))
    return EXIT_OK if document["ok"] else EXIT_FAILURE


def api_key(name: str, keys_file: Path | None, replace: bool = False,
            revoke: bool = False) -> int:
    """Print a new key and record its hash in ``keys_file`` (or say what line to add);
    ``replace``: the name's old key is revoked in the same write; ``revoke``: only that.

    A key is a user of its own: a new key under a name (replaced, or revoked earlier)
    inherits nothing of the old key's sessions or caches, and this says so."""
    import datetime

    from qvld.http.keys import (
        ApiKeys,
        KeyFileError,
        append_line,
        hash_key,
        new_key,
        revoke_line,
        revoked_names,
        valid_name,
    )

    if not valid_name(name):
        print(f"qvld: api-key: user name {name!r} is not 1-64 characters of [A-Za-z0-9._@-]",
              file=sys.stderr)
        return EXIT_USAGE
    if (replace or revoke) and keys_file is None:
        print("qvld: api-key: --replace and --revoke need --keys-file", file=sys.stderr)
        return EXIT_USAGE
    key = new_key()
    line = f"{name}:{hash_key(key)}"
    if keys_file is None:
        print(key)
        print(f"add to http.api_keys_file: {line}", file=sys.stderr)
        return EXIT_OK
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    try:
        exists = keys_file.exists()
        # Validate the whole file first: changing a broken one would hide the breakage.
        has_key = exists and name in ApiKeys.load(keys_file).names
        earlier = revoked_names(keys_file).get(name) if exists else None
        if (replace or revoke) and not has_key:
            print(f"qvld: api-key: {name} has no key in {keys_file}", file=sys.stderr)
            return EXIT_USAGE
        if has_key and not (replace or revoke):
            print(f"qvld: api-key: {name} already has a key in {keys_file}; --replace "
                  "issues a new one (the old one stops working at the next reload, and "
                  "its sessions end)", file=sys.stderr)
            return EXIT_USAGE
        if has_key:
            revoke_line(keys_file, name, now + (" (replaced)" if replace else ""))
        if revoke:
            print(f"revoked {name}'s key in {keys_file}; reload the daemon (systemctl "
                  "reload qvld): the key stops working and its sessions end",
                  file=sys.stderr)
            return EXIT_OK
        append_line(keys_file, line, keys_file.exists())
    except KeyFileError as exc:
        for error in exc.errors:
            print(f"qvld: api-key: {error}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as exc:
        print(f"qvld: api-key: {keys_file}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_FAILURE
    # The key goes out only once its hash is safely on disk.
    print(key)
    if has_key or earlier is not None:
        when = "replaced now" if has_key else f"revoked {earlier}"
        print(f"{name} had a key before ({when}): the new key is a new user, with none "
              "of the old key's sessions or caches", file=sys.stderr)
    print(f"added {name} to {keys_file}; reload the daemon: systemctl reload qvld",
          file=sys.stderr)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    enable_crash_traces()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "api-key":
        # Before the config: issuing a key needs neither a config nor a model.
        if args.name is None:
            parser.error("api-key needs a user NAME")
        return api_key(args.name, args.keys_file, args.replace, args.revoke)
    if args.name is not None:
        parser.error(f"unrecognized arguments: {args.name}")
    try:
        path, overrides = config_source(args)
        config = load_config(path, overrides)
    except ConfigError as exc:
        for line in exc.errors:
            print(f"qvld: config: {line}", file=sys.stderr)
        return EXIT_CONFIG
    if args.command == "check-config":
        return check_config(config)
    if args.command == "preflight":
        return preflight(config, args.json, args.textfile)
    from qvld.app import App, setup_logging

    setup_logging(config)
    if config.model.path is None:
        print("qvld: model.path is not set (--model DIR or model.path in the config)",
              file=sys.stderr)
        return EXIT_CONFIG
    return asyncio.run(App(config, path, overrides).run())


if __name__ == "__main__":
    raise SystemExit(main())
