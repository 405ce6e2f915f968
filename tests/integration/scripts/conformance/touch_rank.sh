#!/bin/bash
# Conformance worker run with --no-python: create a file named after the
# global rank in the folder given as the first argument.
target="$1/$RANK"
echo "creating $target"
touch "$target"
