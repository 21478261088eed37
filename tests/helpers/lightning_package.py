"""The Lightning package the Lightning workers run on: ``pytorch_lightning``, or the unified ``lightning.pytorch``
with ``GOSSIP_TEST_LIGHTNING=lightning.pytorch``.

Imported by a worker before :mod:`gossip.integrations.lightning`, which builds on the package already imported
(``gossip.integrations.lightning.LIGHTNING_PACKAGE``); the unified package's run never imports ``pytorch_lightning``.
"""

from __future__ import annotations

import importlib
import os

#: the package's name
PACKAGE = os.environ.get("GOSSIP_TEST_LIGHTNING", "pytorch_lightning")
#: the package (``import pytorch_lightning as pl`` or ``import lightning.pytorch as pl``)
pl = importlib.import_module(PACKAGE)
