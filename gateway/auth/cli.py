"""``gateway token``: mint a SAS token for a rule and print a ready ``Authorization`` value.

    gateway token --rules auth.toml --rule sender --entity orders [--host gw.example.com]
                  [--ttl 1h] [--secondary] [--curl https://gw.example.com]
    gateway token --key - --rule sender --entity orders < key.txt

stdout carries only the header value (and, with ``--curl``, a sample curl line), so
``AUTH=$(gateway token ...)`` works; notes and warnings go to stderr. Exit status: 0 printed,
1 configuration problem (unreadable rules, unknown rule, no secondary key), 2 usage error.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import time
from datetime import UTC, datetime
from urllib.parse import urlsplit, urlunsplit

from gateway.auth._paths import entity_segments
from gateway.auth.errors import AuthConfigError
from gateway.auth.rules import AuthRule, Right, Secret, load_rules, valid_key_name
from gateway.auth.sas import mint_token, resource_uri

DEFAULT_HOST = "localhost:8080"
DEFAULT_TTL = 3600.0
_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)([smhd]?)")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def _duration(text: str) -> float:
    match = _DURATION.fullmatch(text.strip())
    if match is None or float(match[1]) <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive duration (seconds, or a number with s/m/h/d)"
        )
    return float(match[1]) * _UNITS[match[2]]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gateway token",
        description="Mint a Service Bus SAS token for the gateway and print the "
        "Authorization header value.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--rules", metavar="FILE", help="rules file (TOML or JSON)")
    source.add_argument(
        "--key",
        metavar="KEY",
        help="sign with this key instead of a rules file ('-' reads it from stdin; "
        "a key on the command line is visible to other local users)",
    )
    parser.add_argument("--rule", metavar="NAME", required=True, help="rule (key) name: skn")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--entity", metavar="ENTITY", help="entity path, e.g. orders")
    target.add_argument(
        "--namespace",
        action="store_true",
        help="sign the namespace root (covers every entity and /admin)",
    )
    parser.add_argument(
        "--host",
        metavar="HOST",
        help=f"public host[:port] of the gateway (default: from --curl, else {DEFAULT_HOST})",
    )
    parser.add_argument(
        "--scheme",
        choices=("https", "http", "sb"),
        help="resource URI scheme (default: from --curl, else https)",
    )
    parser.add_argument(
        "--ttl",
        type=_duration,
        default=DEFAULT_TTL,
        metavar="SECONDS",
        help="lifetime: seconds or e.g. 15m, 12h, 7d (default 3600)",
    )
    parser.add_argument(
        "--secondary", action="store_true", help="sign with the rule's secondary key"
    )
    parser.add_argument(
        "--curl",
        metavar="URL",
        help="also print a sample curl command posting to URL "
        "(a bare base URL gets /<entity>/messages appended)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``gateway token`` with *argv* (the arguments after ``token``); return the exit code.

    Never raises for bad input: usage errors return 2 (argparse's message on stderr),
    configuration errors return 1 with ``error: ...`` on stderr. Keys are never printed.
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return _run(args)
    except (AuthConfigError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    entity: str | None = None if args.namespace else args.entity
    if entity is not None and entity_segments(entity) is None:
        raise ValueError(f"--entity {entity!r} is not a valid entity path")
    if not valid_key_name(args.rule):
        raise ValueError(f"--rule {args.rule!r} is not a valid rule name")
    curl_url = urlsplit(args.curl) if args.curl else None
    if curl_url is not None and (curl_url.scheme not in {"http", "https"} or not curl_url.netloc):
        raise ValueError(f"--curl {args.curl!r} is not an http(s) URL")
    host = args.host or (curl_url.netloc if curl_url is not None else DEFAULT_HOST)
    scheme = args.scheme or (curl_url.scheme if curl_url is not None else "https")

    rule: AuthRule | None = None
    if args.rules is not None:
        rules = {r.name: r for r in load_rules(args.rules)}
        rule = rules.get(args.rule)
        if rule is None:
            raise ValueError(
                f"no rule named {args.rule!r} in {args.rules} (have: {', '.join(sorted(rules))})"
            )
        if args.secondary and rule.secondary_key is None:
            raise ValueError(f"rule {args.rule!r} has no secondary_key")
        key = rule.secondary_key if args.secondary and rule.secondary_key else rule.primary_key
        slot = "secondary" if args.secondary else "primary"
    else:
        if args.secondary:
            raise ValueError("--secondary needs --rules (with --key, pass the secondary key)")
        key_text = sys.stdin.readline().strip() if args.key == "-" else args.key
        if not key_text:
            raise ValueError("--key is empty")
        key, slot = Secret(key_text), "given"

    uri = resource_uri(host, entity, scheme=scheme)
    now = time.time()
    header = mint_token(uri, args.rule, key, args.ttl, now=now)
    expires = datetime.fromtimestamp(int(now + args.ttl), UTC).isoformat()
    print(f"# rule {args.rule} ({slot} key), resource {uri}, expires {expires}", file=sys.stderr)
    if rule is not None:
        _warn_if_useless(rule, entity)
    print(header)
    if curl_url is not None:
        print(_curl_line(curl_url.geturl(), entity, header))
    return 0


def _warn_if_useless(rule: AuthRule, entity: str | None) -> None:
    """Tell the operator now, rather than with a 403 later, when the rule cannot do the job."""
    target = "the namespace" if entity is None else f"entity {entity!r}"
    if not rule.applies_to(None if entity is None else entity_segments(entity)):
        print(f"# warning: rule {rule.name!r} does not apply to {target}", file=sys.stderr)
    # A namespace token either sends to every entity (the load test's) or manages (/admin).
    wanted = (Right.SEND, Right.MANAGE) if entity is None else (Right.SEND,)
    if not any(rule.grants(right) for right in wanted):
        print(
            f"# warning: rule {rule.name!r} does not grant "
            f"{' or '.join(r.value for r in wanted)}; requests needing it will get 403",
            file=sys.stderr,
        )


def _curl_line(url: str, entity: str | None, header: str) -> str:
    parts = urlsplit(url)
    if entity is not None and parts.path in {"", "/"}:
        parts = parts._replace(path=f"/{entity.strip('/')}/messages")
    target = urlunsplit(parts)
    command = [
        "curl",
        "-sS",
        "-i",
        "-X",
        "POST",
        target,
        "-H",
        f"Authorization: {header}",
        "-H",
        "Content-Type: text/plain",
        "--data-binary",
        "hello from sbgate",
    ]
    return shlex.join(command)


if __name__ == "__main__":  # pragma: no cover - `python -m gateway.auth.cli`
    raise SystemExit(main())
