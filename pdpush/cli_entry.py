"""``python -m pdpush.cli_entry {receiver,sender,pdpush} ...``: console scripts without installing.

Used by launch.py so tests and the bench run the same entry points as the
installed ``pdpush-receiver`` / ``pdpush-sender`` scripts.
"""

from __future__ import annotations

import sys


def main() -> None:
    from pdpush import cli

    role = sys.argv[1] if len(sys.argv) > 1 else ""
    if role in ("receiver", "sender"):
        del sys.argv[1]
        sys.argv[0] = f"pdpush-{role}"
        (cli.receiver_main if role == "receiver" else cli.sender_main)()
    else:
        sys.argv[0] = "pdpush"
        cli.main()


if __name__ == "__main__":
    main()
