"""`python -m cute_flash`'s subcommands on the CPU: each one's --help says what it does."""
import subprocess
import sys

import pytest

COMMANDS = ["compile", "layouts", "check", "bench", "overhead", "coldstart", "tune", "traincheck", "cp", "memcheck",
            "racecheck", "occupancy"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_help_says_what_it_does(command):
    run = subprocess.run([sys.executable, "-m", "cute_flash", command, "--help"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    usage, description = run.stdout.split("\n\n")[:2]
    assert usage.startswith(f"usage: python -m cute_flash {command}")
    assert len(description.split()) >= 4 and not description.startswith("options:"), run.stdout
