"""Worker: leaves a torch-format error file whose message and traceback carry
terminal escapes (window title, clear screen, colour), then exits 1. Nothing
is printed: only the agent's failure summary can show them.
"""

import json
import os
import sys

ESC = "\x1b]0;owned\x07\x1b[2J"
message = f"boom {ESC}"
traceback = (
    "Traceback (most recent call last):\n"
    '  File "train.py", line 1, in <module>\n'
    f"\x1b[31mRuntimeError: forged {ESC}\x1b[0m\n"
)
with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as fp:
    json.dump(
        {
            "message": {
                "message": message,
                "extraInfo": {"py_callstack": traceback, "timestamp": "0"},
            }
        },
        fp,
    )
sys.exit(1)
