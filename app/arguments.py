"""Value types for the command line's arguments, shared by every subcommand's parser
(`app/cli.py`, `app/headless.py`, `app/server/cli.py`): each module that adds arguments
imports them from here, so none of them imports the command that registers it."""

from __future__ import annotations

import argparse


def number(kind, minimum, *, inclusive=True):
    """An argparse type: `kind` (int or float) at least (or, not inclusive, above) `minimum`."""
    name = "a whole number" if kind is int else "a number"
    bound = f"{minimum} or more" if inclusive else f"above {minimum}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {name}")
        if value < minimum or (value == minimum and not inclusive):
            raise argparse.ArgumentTypeError(f"{text!r} must be {bound}")
        return value

    return parse


positive_int = number(int, 1)
non_negative_int = number(int, 0)
positive_float = number(float, 0, inclusive=False)


def comma_separated(parse_item):
    """An argparse type: a comma-separated list ("1,2,4"), each item read by `parse_item`
    (an argparse type, or a tuple of the allowed words); repeats dropped, order kept."""

    def parse(text: str) -> list:
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"{text!r} lists nothing")
        if isinstance(parse_item, tuple):
            unknown = [item for item in items if item not in parse_item]
            if unknown:
                raise argparse.ArgumentTypeError(f"{unknown[0]!r} is not one of {', '.join(parse_item)}")
            values = items
        else:
            values = [parse_item(item) for item in items]
        return list(dict.fromkeys(values))

    return parse
