"""``cmdbus-trio``: the command line (docs/clients.md, "Command line")."""

from __future__ import annotations

import argparse
import difflib
import inspect
import logging
import os
import re
import sys
from collections.abc import Sequence
from typing import Protocol

import attrs
import trio

from . import __version__, logs
from .client._shards import WRITERS_ENV
from .commands import bench, client, diagnose, ha, import_tier
from .commands._output import INTERRUPTED, leaves
from .commands._serve_help import add_setting_arguments
from .commands.backups import Backup, Check, Restore
from .commands.client import TOKEN_VARIABLE
from .config import SETTINGS, Config, ConfigError, descriptors, load, noetl, unknown_variables
from .logs import event
from .storage import datadir
from .tracing import setup as tracing_setup
from .tracing import spans

log = logging.getLogger(__name__)


class _Command(Protocol):
    """A command module: its docstring is its ``--help`` description."""

    HELP: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


_COMMANDS: dict[str, _Command] = {
    "client": client,
    "bench": bench,
    "diagnose": diagnose,
    "ha": ha,
    "import-tier": import_tier,
    "backup": Backup(),
    "restore": Restore(),
    "check": Check(),
}
KNOWN_VARIABLES = (
    *(setting.env for setting in SETTINGS),
    *(names[0] for names in WRITERS_ENV.values()),  # the clients' own
    TOKEN_VARIABLE,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cmdbus-trio",
        description="Durable command bus, event bus and tier service.",
        epilog=f"{', '.join(SHARED_FLAGS)} may come before the command as well as after it.",
    )
    parser.add_argument("--version", action="version", version=f"cmdbus-trio {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        usage="cmdbus-trio serve [--SETTING VALUE ...]",
        help="run the writer",
        description="Run the writer. Every setting is a flag and a CMDBUS_* variable; "
        "a flag wins over the variable, which wins over the default.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_setting_arguments(serve)
    for name, command in _COMMANDS.items():
        command.add_arguments(
            commands.add_parser(
                name,
                help=command.HELP,
                description=plain(inspect.cleandoc(command.__doc__ or "")),
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
        )
    _whole_flags_only(parser)
    return parser


_MARKUP = re.compile(r"``([^`]+)``|:\w+:`([^`]+)`|\*\*([^*]+)\*\*")


def plain(docstring: str) -> str:
    """A docstring as help text: reST's ``literals``, :roles:`x` and **bold** shown as
    the words they mark (``--help`` printed them raw)."""
    return _MARKUP.sub(lambda m: next(g for g in m.groups() if g is not None), docstring)


def _whole_flags_only(parser: argparse.ArgumentParser) -> None:
    """No flag is matched by a prefix, in any (sub)command: ``serve --ack-wait 5`` was
    taken as ``--ack-wait-ms 5``, a 5 ms lease, by someone thinking in NoETL's
    ``*_ACK_WAIT_SECS``. (Set on each parser: subparsers do not inherit it.)"""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _whole_flags_only(child)


def _refuse_unknown(
    parser: argparse.ArgumentParser, args: argparse.Namespace, unknown: list[str]
) -> None:
    """Exit 2 with the usage of the (sub)command that was given, not the top level's,
    and the flag it has that is nearest to each unknown one."""
    chosen = parser
    while True:  # down the subcommands named in ``args``
        for action in chosen._actions:
            if isinstance(action, argparse._SubParsersAction) and action.dest:
                name = getattr(args, action.dest, None)
                if name in action.choices:
                    chosen = action.choices[name]
                    break
        else:
            break
    flags = [flag for action in chosen._actions for flag in action.option_strings]
    said = []
    for word in unknown:
        near = difflib.get_close_matches(word.split("=", 1)[0], flags, n=1, cutoff=0.75)
        said.append(f"{word} (did you mean {near[0]}?)" if near else word)
    chosen.error(f"unrecognized arguments: {' '.join(said)}")


SHARED_FLAGS: dict[str, int] = {
    "--server": 1,
    "--token": 1,
    "--tls-ca": 1,
    "--reconnect-for": 1,
    "--json": 0,
    "--human": 0,
}
"""Flags many commands take, with the values each takes: a person may put them before
the command too (``cmdbus-trio --server X client lag``)."""


def hoisted(argv: Sequence[str]) -> list[str]:
    """``argv`` with the :data:`SHARED_FLAGS` given before the command moved after it,
    where argparse reads them (a subcommand's defaults would otherwise overwrite the
    top-level parser's values). A command that does not take one refuses it by name."""
    i = 0
    moved: list[str] = []
    while i < len(argv) and (name := argv[i].split("=", 1)[0]) in SHARED_FLAGS:
        width = 1 + (0 if "=" in argv[i] else SHARED_FLAGS[name])
        moved += argv[i : i + width]
        i += width
    return [*argv[i:], *moved]


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = _parser()
        args, unknown = parser.parse_known_args(hoisted(sys.argv[1:] if argv is None else argv))
        if unknown:
            _refuse_unknown(parser, args, unknown)
        if args.command == "serve":
            return _serve(vars(args))
        if args.command in _COMMANDS:
            return _COMMANDS[args.command].run(args)
        raise AssertionError(args.command)  # argparse allows only the commands above
    except KeyboardInterrupt:
        pass
    except BaseExceptionGroup as group:  # from inside a trio.run's nursery
        if not all(isinstance(leaf, KeyboardInterrupt) for leaf in leaves(group)):
            raise
    print("cmdbus-trio: interrupted", file=sys.stderr, flush=True)
    return INTERRUPTED


def _serve(flags: dict[str, str | None]) -> int:
    try:
        translated = noetl.translate(os.environ, flags)
    except ConfigError as exc:
        print(f"cmdbus-trio: {exc}", file=sys.stderr)
        return 2
    try:
        config = load(flags, environ=translated.environ)
    except ConfigError as exc:
        print(f"cmdbus-trio: {translated.explain(exc)}", file=sys.stderr)
        return 2
    try:
        data_dir = datadir.claim(config.data_dir)
    except datadir.DataDirError as exc:
        print(f"cmdbus-trio: {datadir.SETTING}: {exc}", file=sys.stderr)
        return 2
    with data_dir:
        return _run(config, translated)


def _run(config: Config, translated: noetl.Translation) -> int:
    config = attrs.evolve(config, log_format=logs.resolved(config.log_format, sys.stderr))
    logs.configure(config.log_format, config.log_level)
    for alias, setting in translated.used:
        event(log, logging.INFO, "noetl_alias", variable=alias, read_as=setting)
    if translated.ignored:
        event(log, logging.WARNING, "noetl_ignored", variables=list(translated.ignored))
    for name, nearest in unknown_variables(os.environ, KNOWN_VARIABLES):
        hint = f"did you mean {nearest}?" if nearest else "no setting has a name near it"
        event(log, logging.WARNING, "unknown_variable", variable=name, hint=hint)
    try:
        config = descriptors.fit(config)
    except ConfigError as exc:
        print(f"cmdbus-trio: {translated.explain(exc)}", file=sys.stderr)
        return 2
    # Imported here: the server is most of the package, and every other command (run by
    # an operator, in a script, by a probe) starts a third sooner without it (0.45 s, not
    # 0.69 s, on a 2-CPU machine).
    from . import app

    provider = tracing_setup.from_environment(os.environ)
    spans.use(provider)
    try:
        trio.run(app.serve_until_signalled, config)
    except BaseExceptionGroup as group:
        unusable, rest = group.split(datadir.DataDirError)
        startup_errors, rest = rest.split(app.StartupError) if rest else (None, None)
        if rest is not None:
            raise
        for error in leaves(unusable) if unusable else ():
            print(f"cmdbus-trio: {datadir.SETTING}: {error}", file=sys.stderr)
        for error in leaves(startup_errors) if startup_errors else ():
            print(f"cmdbus-trio: {error}", file=sys.stderr)
        return 2 if unusable else 1
    finally:
        spans.use(None)
        tracing_setup.shut_down(provider)
    return 0
