"""``python -m pdpush.cli_entry {receiver,sender,pdpush} ...``: console scripts without installing.

Used by launch.py so tests and the bench run the same entry points as the
installed ``pdpush-receiver`` / ``pdpush-sender`` scripts.
"""

from __future__ import annotations

import sys


def main() -> None:
    from pdpush import cli

    role = sys.argv.pop(1) if len(sys.argv) > 1 else ""
    sys.argv[0] = f"pdpush-{role}"
    if role == "receiver":
        cli.receiver_main()
    elif role == "sender":
        cli.sender_main()
    else:
        sys.argv.insert(1, role) if role else None
        cli.main()


if __name__ == "__main__":
    main()
