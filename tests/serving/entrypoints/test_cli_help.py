"""The `xlaserve` user help: every flag it names exists, it tells help requests apart, and
each command's page fits a screen (tests/serving/test_launcher_cli.py runs the command)."""

import pytest
from absl import flags

from serving.entrypoints import cli_help
from serving.entrypoints import flags as xlaserve_flags  # noqa: F401  (defines the flags)
from serving.tools import bench  # noqa: F401  (defines bench's flags)


@pytest.mark.parametrize("command", cli_help.COMMANDS)
def test_every_flag_named_exists(command):
  for _, rows in cli_help.HELP[command].sections:
    for name, text in rows:
      assert name in flags.FLAGS or name in cli_help.PARSER_FLAGS, (
          f"{command} --help names --{name}, which is not a flag")
      assert text.endswith(".") and "\n" not in text, (name, text)


@pytest.mark.parametrize("command", [None, *cli_help.COMMANDS])
def test_each_page_fits_a_screen(command):
  text = cli_help.render(command)
  assert len(text.splitlines()) <= 50
  assert text.startswith("usage: xlaserve" if command else "xlaserve: ")
  if command:
    assert f"xlaserve {command}" in text.split("Example")[1]


def test_defaults_come_from_the_flags():
  assert "--http_port" in cli_help.render("serve")
  line = next(x for x in cli_help.render("serve").splitlines() if "--http_port" in x)
  assert line.endswith(f"(default: {flags.FLAGS['http_port'].default})")
  line = next(x for x in cli_help.render("serve").splitlines() if "--tp " in x)
  assert "default" not in line  # unset by default: from the presets


@pytest.mark.parametrize("argv,wanted,command", [
    (["xlaserve", "--help"], True, None),
    (["xlaserve", "serve", "-h"], True, "serve"),
    (["xlaserve", "--model=m", "generate", "--helpshort"], True, "generate"),
    (["xlaserve", "help", "batch"], True, "batch"),
    (["xlaserve", "-?", "bench", "offline"], True, "bench"),
    (["xlaserve", "serve", "--prompt=--help"], False, "serve"),
    (["xlaserve", "bench", "--", "--help"], False, "bench"),
    (["xlaserve", "serve", "--helpfull"], False, "serve"),  # absl's: every flag
    (["xlaserve"], False, None),
])
def test_help_requests(argv, wanted, command):
  assert cli_help.help_requested(argv) is wanted
  assert cli_help.command_in(argv) == command
