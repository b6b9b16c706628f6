import os
import sys
from pathlib import Path

# Worker functions live in test modules; spawned workers import them by module name.
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
