"""Argument checks the benchmark scripts share, so that a bad value is argparse's usage error (exit 2, naming the
flag) rather than a traceback from deep inside a measurement."""

import argparse


def at_least(lo: float, kind=int):
    "An argparse `type`: a `kind` (int or float) no smaller than `lo`."

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole ' if kind is int else ''}number") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{text} is below {lo}")
        return v

    parse.__name__ = f"{kind.__name__} >= {lo}"  # argparse names the type in its message
    return parse


def int_list(text: str) -> list:
    "An argparse `type`: comma-separated whole numbers, each at least 1."
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers of at least 1, comma-separated")
    return [int(p) for p in parts]


def config_or_usage(parser: argparse.ArgumentParser, load, *args, **kwargs):
    "`load(*args, **kwargs)` (a config loader), or the parser's usage error with its one-line message."
    from cipher_nb.config.load import ConfigError

    try:
        return load(*args, **kwargs)
    except ConfigError as e:
        parser.error(str(e))
