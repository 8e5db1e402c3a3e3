"""Session 22, ad hoc: installed as `sitecustomize.py` in a folder on PYTHONPATH, it sets the
interpreter's GIL switch interval to $SWI seconds in every Python process that starts (the
server that benchmarks/concurrency.py launches among them); unset SWI leaves the default 5 ms."""

import os
import sys

if os.environ.get("SWI"):
    sys.setswitchinterval(float(os.environ["SWI"]))
