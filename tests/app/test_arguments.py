"""The argument types every subcommand shares (app/arguments.py), seen through the parser."""

import pytest

from hybridmoe.app.cli import build_parser


@pytest.mark.parametrize("argv, message", [
    (["run", "-m", "M", "--context", "0"], "'0' must be 1 or more"),
    (["serve", "-m", "M", "--max-tokens-limit", "x"], "'x' is not a whole number"),
    (["serve", "-m", "M", "--max-queue", "-1"], "'-1' must be 0 or more"),
    (["serve", "-m", "M", "--port", "70000"], "'70000' is not a TCP port (0 to 65535)"),
    (["plan", "M", "--target-speed", "0"], "'0' must be above 0"),
])
def test_each_subcommand_refuses_a_bad_number(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_each_subcommand_takes_a_good_number():
    assert build_parser().parse_args(["run", "-m", "M", "--context", "4096"]).context == 4096
    served = build_parser().parse_args(["serve", "-m", "M", "--port", "0", "--max-queue", "0"])
    assert (served.port, served.max_queue) == (0, 0)
