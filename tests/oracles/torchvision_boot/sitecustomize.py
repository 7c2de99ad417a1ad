"""Test scaffolding only (PYTHONPATH of the video oracle's subprocess): PyPI's torchvision is a
CUDA build whose fake-kernel registrations fail against the CPU torch (``operator
torchvision::nms does not exist``); with that module stubbed, its Python transforms (what
transformers' video processors use) run on the CPU. Never part of mmpack's runtime."""

import sys
import types

sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
