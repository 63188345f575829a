import os
import sys

# Helpers (the float64 reference, HF adapters) live beside the tests; pytest runs with
# --import-mode=importlib, so put this folder on sys.path for them.
sys.path.insert(0, os.path.dirname(__file__))
