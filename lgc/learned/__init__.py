"""Learned Gradient Compression and its ablations, as parts held by one hook state.

Abrahamyan et al., "Learned Gradient Compression for Distributed Deep Learning" (2021). Where to
look:

* :mod:`lgc.learned.state`: :class:`LGCHookState`, the hook state that runs the stages and holds
  the parts below;
* :mod:`lgc.learned.rar`, :mod:`lgc.learned.ps`, :mod:`lgc.learned.shared_index`: each
  topology's compressed stage and the public state that assembles it (LGC-RAR, LGC-PS, the
  shared-index and leader-scaled codecs);
* :mod:`lgc.learned.knobs`: the knobs, grouped by part (:class:`Stages`, :class:`LeaderChoice`,
  :class:`CodecTrainingKnobs`), each declared once; the public states are presets of them;
* :mod:`lgc.learned.schedule`: the stages and the refresh (pure);
* :mod:`lgc.learned.plan`: a step's compressed parameters as one vector;
* :mod:`lgc.learned.leader_code`: the leader's positions and the values there on the wire;
* :mod:`lgc.learned.training` and :mod:`lgc.learned.samples`: stage 2, the codec trainer protocol
  and the samples gathered for it;
* :mod:`lgc.learned.step`: a compressed step's context and the collectives the stages share;
* :mod:`lgc.learned.byte_book`: bytes per stage.

The codecs themselves (the autoencoder, the linear codec, their trainers) are in
:mod:`lgc.autoencoder`.
"""

from lgc.learned.knobs import CodecTrainingKnobs, LeaderChoice, Stages
from lgc.learned.ps import LGCParameterServerState
from lgc.learned.rar import LGCRingAllreduceState
from lgc.learned.schedule import LGCStage
from lgc.learned.shared_index import SharedIndexState
from lgc.learned.state import LGCHookState

__all__ = [
    "CodecTrainingKnobs",
    "LGCHookState",
    "LGCParameterServerState",
    "LGCRingAllreduceState",
    "LGCStage",
    "LeaderChoice",
    "SharedIndexState",
    "Stages",
]
