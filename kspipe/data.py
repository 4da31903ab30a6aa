"""Kept for plugins written against kspipe 0.1: the few-shot data now lives in
:mod:`kspipe.fewshot.data` (``FewShotDataset``, ``sample_task``, the Open_KS readers)."""

from kspipe.fewshot.data import *  # noqa: F401,F403
from kspipe.fewshot.data import FewShotDataset, Open_KS_Character, Open_KS_ImageNet, Open_KS_read  # noqa: F401
