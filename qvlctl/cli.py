"""`qvlctl`: ask qvld questions about images, and look at the daemon.

Exit codes: 0 ok; 1 internal error, or the daemon sent a malformed reply; 2 usage
(also an empty --socket); 3 no daemon answers on the socket, or the connection was
lost; 4 the request was refused (bad_request, image_invalid, image_too_large, video_invalid,
prompt_too_long, session_lost, frame_too_large, unsupported_version); 5 busy or unavailable (retry
later; also `health` when not ready, and an answer the daemon cut short, e.g. while
stopping: `ask --json` still prints it); 6 timeout (also `drain` when the admitted
work outlasts --wait-timeout); 7 forbidden (by the daemon, or the
socket's permissions: join the group that owns it); 130 interrupted (Ctrl-C);
141 stdout closed by its reader (`| head`), said nothing.

On a terminal, control characters in answers and in what the daemon reports are shown
as \\xNN instead of being obeyed; through a pipe the text is exact. An empty
QVLD_SOCKET counts as unset.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from qvlctl import exits, render, replies
from qvlctl.asking import ask_params, read_image, sampling_params
from qvlctl.client import (
    DEFAULT_SOCKET,
    AccessDenied,
    Client,
    ConnectFailed,
    MalformedReply,
    default_socket,
)
from qvlctl.exits import (
    EXIT_BY_CODE,
    EXIT_FORBIDDEN,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_NO_DAEMON,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_RETRY,
    EXIT_STDOUT_CLOSED,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    UsageError,
)
from qvld import __version__, protocol
from qvld.errors import QvlError

__all__ = ["EXIT_BY_CODE", "EXIT_FORBIDDEN", "EXIT_INTERNAL", "EXIT_INTERRUPTED",
           "EXIT_NO_DAEMON", "EXIT_OK", "EXIT_REFUSED", "EXIT_RETRY", "EXIT_TIMEOUT",
           "EXIT_USAGE", "build_parser", "main"]


def out(text: str, end: str = "\n") -> None:
    """Text for people on stdout; on a terminal its control characters are shown."""
    sys.stdout.write(render.cleaner(sys.stdout)(text) + end)


def warn(text: str, prefix: str = "qvlctl: ") -> None:
    """One `qvlctl: ...` line on stderr, made as safe as ``out`` (it may quote the daemon)."""
    sys.stderr.write(render.cleaner(sys.stderr)(prefix + text) + "\n")


def cmd_ask(client: Client, args: argparse.Namespace) -> int:
    params = ask_params(args)
    if args.json:
        result = client.generate(params)
        sys.stdout.write(render.json_text(result) + "\n")
    else:
        result = stream_answer(client, params)
    return answer_status(result)


def stream_answer(client: Client, params: dict[str, Any]) -> dict[str, Any]:
    """The answer streamed to stdout as it is generated; timings on stderr."""
    clean = render.cleaner(sys.stdout)  # once, not per token

    def show(text: str, ids: list[int]) -> None:
        sys.stdout.write(clean(text))
        sys.stdout.flush()

    result = client.generate(params, on_token=show)
    sys.stdout.write("\n")
    sys.stdout.flush()
    warn(render.timings_line(result), prefix="")
    return result


def answer_status(result: dict[str, Any]) -> int:
    """The exit status of a finished answer: one the daemon cut short must not pass as 0."""
    if replies.cut_short(result):
        warn(render.CUT_SHORT)
        return EXIT_RETRY
    return EXIT_OK


def cmd_health(client: Client, args: argparse.Namespace) -> int:
    health = client.health()
    if args.json:
        print(json.dumps(health))
    else:
        out(health["state"])
    return EXIT_OK if health["ready"] else EXIT_RETRY


def cmd_status(client: Client, args: argparse.Namespace) -> int:
    status = client.status()
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        out(render.status_text(status))
    return EXIT_OK


def cmd_config(client: Client, args: argparse.Namespace) -> int:
    config = client.config()
    if args.json:
        print(json.dumps(config, indent=2))
    else:  # YAML that qvld reads back (`qvlctl config > qvld.yaml`)
        out(yaml.safe_dump(config, sort_keys=False, allow_unicode=True).rstrip("\n"))
    return EXIT_OK


def cmd_chat(client: Client, args: argparse.Namespace) -> int:
    from qvlctl.chat import Chat

    images = [read_image(name) for name in args.images]
    return Chat(client, sampling_params(args), images, args.system,
                session=args.session).loop()


def cmd_sessions(client: Client, args: argparse.Namespace) -> int:
    if args.close:
        closed = client.close_session(args.close)
        out("closed" if closed else "no such session")
        return EXIT_OK if closed else EXIT_REFUSED
    sessions = client.sessions(all_users=args.all)
    if args.json:
        print(json.dumps(sessions))
        return EXIT_OK
    out(render.sessions_table(sessions))
    return EXIT_OK


def cmd_preflight(client: Client, args: argparse.Namespace) -> int:
    document = client.preflight()
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        for line in protocol.preflight_lines(document):
            out(line)
    return EXIT_OK if document["ok"] else EXIT_INTERNAL


def cmd_metrics(client: Client, args: argparse.Namespace) -> int:
    text = client.metrics()
    if args.summary:
        out(render.metrics_summary(text))
    else:
        out(text, end="")
    return EXIT_OK


def cmd_reload(client: Client, args: argparse.Namespace) -> int:
    result = client.reload()
    if args.json:
        print(json.dumps(result))
    elif result["reloaded"]:
        out(f"reloaded: serving {result.get('model')}")
        for key in result.get("restart_required", []):
            warn(f"note: {key} changed; it takes effect after a restart", prefix="")
    if not result["reloaded"]:
        if not args.json:
            warn(f"reload failed; still serving the previous model: {result.get('error')}")
        return EXIT_INTERNAL
    return EXIT_OK


def cmd_drain(client: Client, args: argparse.Namespace) -> int:
    """Stop admitting, then (unless --no-wait) wait until the admitted work is done."""
    result = client.drain("start")
    deadline = time.monotonic() + args.wait_timeout
    while not args.no_wait and result["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.2)  # the daemon has no drain-finished event to wait on
        result = client.drain("status")
    gave_up = not args.no_wait and result["in_flight"] > 0
    if args.json:
        print(json.dumps(result))
    elif gave_up:
        warn(f"still {result['in_flight']} generation(s) running after "
             f"{args.wait_timeout:g} s; the daemon stays drained")
    else:
        running = f", {result['in_flight']} generation(s) still running" \
            if result["in_flight"] else ", nothing running"
        out(f"{result['state']}: taking no new generations{running}")
    return EXIT_TIMEOUT if gave_up else EXIT_OK


def cmd_resume(client: Client, args: argparse.Namespace) -> int:
    result = client.drain("stop")
    if args.json:
        print(json.dumps(result))
    else:
        out(f"{result['state']}: taking generations again")
    return EXIT_OK if result["state"] == "ready" else EXIT_RETRY


def cmd_model(args: argparse.Namespace) -> int:
    """The model commands work on directories: no daemon involved. This is only their
    front: the tooling is qvld's (``qvld.modeltools``), imported when one of them runs."""
    if args.model_command in ("pull", "list"):
        return cmd_model_hub(args)
    from qvld.modeltools import convert as model

    if args.model_command == "convert":
        recipe = model.Recipe(weights=args.weights, symmetric=not args.asym,
                              group_size=args.group_size, ratio=args.ratio,
                              all_layers=not args.lm_head_int8)
        return model.convert(args.src, args.dst, recipe)
    if args.model_command == "export-onnx":
        from qvld.modeltools import onnx_export

        return onnx_export.export_onnx(args.src, args.dst, args.weights)
    if args.model_command == "info":
        document = model.info(args.dir)
        print(json.dumps(document, indent=2) if args.json else model.render_info(document))
        return EXIT_OK if document.get("loadable") else EXIT_REFUSED
    report = model.verify(args.dir, args.reference, args.backend)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for row in report["results"]:
            print(f"{'ok  ' if row['exact'] else 'DIFF'} {row['name']}: "
                  f"{row['agreeing']}/{row['tokens']} tokens agree")
        print(f"{report['exact']}/{report['cases']} cases exact, token agreement "
              f"{report['token_agreement']:.1%}")
    return EXIT_OK if report["exact"] == report["cases"] else EXIT_INTERNAL


def cmd_model_hub(args: argparse.Namespace) -> int:
    """`model pull` and `model list` (no engine until a pulled model is checked)."""
    from qvld.modeltools import pull

    if args.model_command == "list":
        root = args.dir or pull.models_dir()
        rows = pull.listing(root)
        print(json.dumps(rows, indent=2) if args.json else pull.render_listing(rows, root))
        return EXIT_OK
    name = args.name if args.revision is None else f"{args.name}@{args.revision}"
    try:
        path = pull.pull(name, args.dir, check=not args.no_check, convert=not args.no_convert)
    except pull.PullError as exc:
        warn(str(exc))
        return EXIT_REFUSED
    print(path)
    return EXIT_OK


# qvld.config.INSTANCE_NAME (not imported: qvlctl stays clear of pydantic and yaml's
# schema at start-up)
INSTANCE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def instance_socket(name: str) -> str:
    if not INSTANCE_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(f"an instance name is 1-64 of [A-Za-z0-9_-], "
                                         f"not {name!r}")
    return str(Path(DEFAULT_SOCKET).with_name(f"qvld-{name}.sock"))


def socket_path(value: str) -> str:
    """--socket's type: an explicit empty path is a mistake, not a wish for the default."""
    if not value:
        raise argparse.ArgumentTypeError(
            "an empty path names no socket (leave --socket out to use $QVLD_SOCKET or "
            "/run/qvld/qvld.sock)")
    return value


JSON_HELP = "print the result as JSON (for scripts)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qvlctl", description="Query and manage the qvld vision-language daemon.",
        epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--socket", default=default_socket(), type=socket_path,
                       help="daemon socket (default: $QVLD_SOCKET or /run/qvld/qvld.sock)")
    where.add_argument("--instance", metavar="NAME", type=instance_socket, dest="socket",
                       help="the socket of instance NAME of the template units, "
                            "/run/qvld/qvld-NAME.sock (qvld@NAME.service)")
    parser.add_argument("--version", action="version", version=f"qvlctl {__version__}")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds to wait for the daemon (default: no limit)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="what to do (qvlctl COMMAND --help for its options)")
    model_default = "default: the model's generation_config.json"

    sampling = argparse.ArgumentParser(add_help=False)
    sampling.add_argument("--max-tokens", dest="max_tokens", type=int,
                          help="tokens to generate at most (default: the daemon's "
                               "engine.default_max_tokens; unset, until the answer or "
                               "the context ends)")
    sampling.add_argument("--temperature", type=float, help=f"0 = greedy ({model_default})")
    sampling.add_argument("--top-p", dest="top_p", type=float,
                          help=f"nucleus sampling mass, (0, 1] ({model_default})")
    sampling.add_argument("--top-k", dest="top_k", type=int,
                          help=f"sample among the k likeliest tokens, 0 = off ({model_default})")
    sampling.add_argument("--repetition-penalty", dest="repetition_penalty", type=float,
                          help=f"> 1 discourages repeats of prompt and answer ({model_default})")
    sampling.add_argument("--presence-penalty", dest="presence_penalty", type=float,
                          help="-2..2, per token already generated (default: 0)")
    sampling.add_argument("--frequency-penalty", dest="frequency_penalty", type=float,
                          help="-2..2, times how often a token was generated (default: 0)")
    sampling.add_argument("--seed", type=int,
                          help="makes sampling repeatable (default: a fresh random seed)")
    sampling.add_argument("--stop", action="append", help="stop string (repeatable)")
    sampling.add_argument("--max-image-tokens", dest="max_image_tokens", type=int,
                          help="each image's token budget (default: the daemon's "
                               "engine.default_image_tokens)")
    sampling.add_argument("--system", help="a system prompt")
    sampling.add_argument("--session", help="session id for multi-turn reuse")

    ask = sub.add_parser("ask", help="ask a question, optionally about images",
                         parents=[sampling],
                         usage="qvlctl ask [IMAGE ...] QUESTION [options]\n"
                               "       qvlctl ask --messages FILE.json [options]")
    ask.add_argument("args", nargs="*", metavar="IMAGE... QUESTION",
                     help="image or video files ('-' reads stdin; a video is known by "
                          "its content: MP4, WebM, MKV, AVI) and the question, in any "
                          "order (the arguments that are not files); without one, the "
                          "question is read from stdin")
    ask.add_argument("--messages", type=Path, help="a JSON array of messages instead")
    ask.add_argument("--json", action="store_true", help="print the result as one JSON object")
    shape = ask.add_argument_group("answer format (constrained decoding)")
    shape = shape.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", dest="json_schema", type=Path, metavar="FILE",
                       help="the answer is JSON valid against this JSON Schema")
    shape.add_argument("--json-object", dest="json_object", action="store_true",
                       help="the answer is a JSON object")
    shape.add_argument("--regex", metavar="PATTERN", help="the answer matches this regex")
    shape.add_argument("--grammar", type=Path, metavar="FILE",
                       help="the answer matches this Lark or GBNF grammar")
    ask.set_defaults(func=cmd_ask)

    chat = sub.add_parser("chat", parents=[sampling],
                          help="a conversation about images, kept as a daemon session "
                               "(/image PATH, /video PATH, /set KEY VALUE, /reset, /quit; "
                               "Ctrl-C stops an answer, Ctrl-D leaves)")
    chat.add_argument("images", nargs="*", metavar="IMAGE",
                      help="images for the first message")
    chat.set_defaults(func=cmd_chat)

    model = sub.add_parser("model", help="pull, convert, list, inspect and verify models")
    msub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION",
                                help="what to do with a model directory")
    conv = msub.add_parser("convert", help="checkpoint (directory or hub id) -> OpenVINO "
                                           "export qvld serves (needs the convert extra)")
    conv.add_argument("src", help="a Hugging Face checkpoint: a directory or a hub id")
    conv.add_argument("dst", type=Path, help="the model directory to write")
    conv.add_argument("--weights", choices=["int4", "int8", "fp16", "fp32"], default="int8",
                      help="weight compression (default: int8)")
    conv.add_argument("--asym", action="store_true",
                      help="asymmetric quantisation with zero points (optimum's default; "
                           "slower to decode here)")
    conv.add_argument("--group-size", dest="group_size", type=int, default=-1,
                      help="weights per scale; -1 (default): one scale per output channel")
    conv.add_argument("--ratio", type=float, default=1.0,
                      help="int4: share of the layers in 4 bits, the rest int8 (default 1)")
    conv.add_argument("--lm-head-int8", dest="lm_head_int8", action="store_true",
                      help="int4: keep lm_head and the embeddings in int8 (slower)")
    onnx = msub.add_parser("export-onnx", help="checkpoint -> ONNX graphs for "
                                               "model.backend: onnxruntime (convert extra)")
    onnx.add_argument("src", help="a Hugging Face checkpoint: a directory or a hub id")
    onnx.add_argument("dst", type=Path,
                      help="a new directory for the graphs, or one holding this "
                           "checkpoint's OpenVINO IR: the graphs go beside it (images "
                           "and prompts on ONNX Runtime, model.prompt_backend)")
    onnx.add_argument("--weights", choices=["fp32", "int8"], default="int8",
                      help="int8 (default): onnxruntime's dynamic quantisation of every "
                           "MatMul weight, per output channel")
    mpull = msub.add_parser("pull", help="download an OpenVINO export from the Hugging "
                                         "Face hub, checked, then loaded once")
    mpull.add_argument("name", help="qwen3-vl-2b (-int8, -int4), or a hub repository "
                                    "ORG/NAME[@REVISION] (HF_ENDPOINT, HF_TOKEN honoured)")
    mpull.add_argument("dir", type=Path, nargs="?",
                       help="where to put it (default: the models directory, "
                            "$QVLD_MODELS or /var/lib/qvld/models)")
    mpull.add_argument("--revision", help="a branch, tag or commit (default: main)")
    mpull.add_argument("--no-check", dest="no_check", action="store_true",
                       help="do not load the model to answer one question afterwards")
    mpull.add_argument("--no-convert", dest="no_convert", action="store_true",
                       help="refuse a transformers checkpoint instead of converting it "
                            "(converting needs the convert extra)")
    mlist = msub.add_parser("list", help="the models pulled: where, how big, from where")
    mlist.add_argument("--dir", type=Path, help="the models directory to list")
    mlist.add_argument("--json", action="store_true", help=JSON_HELP)
    minfo = msub.add_parser("info", help="what a model directory holds")
    minfo.add_argument("dir", type=Path, help="a model directory")
    minfo.add_argument("--json", action="store_true", help=JSON_HELP)
    mver = msub.add_parser("verify", help="run reference cases, report token agreement")
    mver.add_argument("dir", type=Path, help="a model directory")
    mver.add_argument("--reference", type=Path,
                      help="reference.json with the expected token ids (default: the one "
                           "in DIR)")
    mver.add_argument("--backend", choices=["openvino", "onnxruntime"], default="openvino",
                      help="the runtime to verify (onnxruntime: the onnx_*.onnx graphs)")
    mver.add_argument("--json", action="store_true", help=JSON_HELP)
    model.set_defaults(func=None, offline=cmd_model)

    pre = sub.add_parser("preflight", help="the daemon's system checks and applied tuning")
    pre.add_argument("--json", action="store_true", help=JSON_HELP)
    pre.set_defaults(func=cmd_preflight)

    metrics = sub.add_parser("metrics", help="Prometheus metrics (or a short summary)")
    metrics.add_argument("--summary", action="store_true", help="a few lines for people")
    metrics.set_defaults(func=cmd_metrics)

    sessions = sub.add_parser("sessions", help="list your sessions, or close one")
    sessions.add_argument("--close", metavar="ID", help="close this session")
    sessions.add_argument("--all", action="store_true", help="everyone's (admin)")
    sessions.add_argument("--json", action="store_true", help=JSON_HELP)
    sessions.set_defaults(func=cmd_sessions)

    drain = sub.add_parser(
        "drain", help="take no new generations, finish the admitted ones (admin); health "
        "says not ready, so a load balancer moves traffic away; `resume` undoes it")
    drain.add_argument("--no-wait", action="store_true",
                       help="return at once instead of waiting for running generations")
    drain.add_argument("--wait-timeout", type=float, default=600.0, metavar="SECONDS",
                       help="give up waiting after this long, exit 6 (default: %(default)s)")
    drain.add_argument("--json", action="store_true", help=JSON_HELP)
    drain.set_defaults(func=cmd_drain)

    for name, func, text in (("health", cmd_health, "daemon state; exit 0 only when ready"),
                             ("status", cmd_status, "daemon and model status"),
                             ("config", cmd_config, "the daemon's effective configuration"),
                             ("resume", cmd_resume,
                              "take new generations again after a drain (admin)"),
                             ("reload", cmd_reload,
                              "reload config and model (admin); the old one serves on "
                              "failure")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--json", action="store_true", help=JSON_HELP)
        p.set_defaults(func=func)
    return parser


def stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll says POLLERR on its end);
    then stdout points at /dev/null from now on, so that the interpreter's own flush at
    exit does not fail once more."""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        broken = any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):  # no real file behind stdout
        return False
    if broken:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    return broken


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "offline", None) is not None:
            return int(args.offline(args))
        with Client(args.socket, timeout=args.timeout) as client:
            status = int(args.func(client, args))
        sys.stdout.flush()  # here, where a closed stdout is still ours to handle
        return status
    except BrokenPipeError:
        if not stdout_closed():
            warn("connection lost: the daemon closed the connection")
            return EXIT_NO_DAEMON
        return EXIT_STDOUT_CLOSED  # `qvlctl status | head`: the reader had enough
    except UsageError as exc:
        warn(str(exc))
        return EXIT_USAGE
    except AccessDenied as exc:  # before OSError: the daemon may be fine, we may not enter
        warn(exc.strerror or str(exc))
        return EXIT_FORBIDDEN
    except ConnectFailed as exc:
        warn(exc.strerror or str(exc))
        return EXIT_NO_DAEMON
    except MalformedReply as exc:  # the daemon's fault: neither a refusal nor a lost line
        warn(f"the daemon sent a malformed reply: {exc.detail}")
        return EXIT_INTERNAL
    except QvlError as exc:
        warn(f"{exc.code}: {exc.message}")
        return exits.for_error_code(exc.code)
    except TimeoutError:
        warn("timeout: the daemon did not answer in time")
        return EXIT_TIMEOUT
    except (ConnectionError, OSError) as exc:
        warn(f"connection lost: {exc}")
        return EXIT_NO_DAEMON
    except KeyboardInterrupt:  # the user's own stop: no message, the shell's status
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    raise SystemExit(main())
