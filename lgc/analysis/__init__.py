"""Gradient statistics used by the notebooks: record the workers' gradients, compare them, plot them.

:class:`GradientRecorder` (a Lightning callback) saves every worker's local gradients;
:func:`load_recording` reads them back; :mod:`lgc.analysis.correlation` measures how alike the
workers' gradients are; :mod:`lgc.analysis.plots` draws it; :func:`record_gradients` runs a short
recorded training on the embedded task; :func:`read_offline_run` reads an offline wandb run.
"""

from lgc.analysis.correlation import (
    compare_recordings,
    cross_worker_cosine,
    leader_position_statistics,
    pairwise_cosine,
    pairwise_topk_jaccard,
    random_topk_jaccard,
    recording_cosine,
    recording_topk_jaccard,
    summarize_recording,
    topk_jaccard,
)
from lgc.analysis.plots import plot_cosine_over_time, plot_topk_jaccard_over_time
from lgc.analysis.record import compose_recording_config, record_gradients
from lgc.analysis.recorder import GradientRecorder, select_parameters
from lgc.analysis.recording import RECORDING_FORMAT, GradientRecording, load_recording
from lgc.analysis.wandb_offline import OfflineRun, read_offline_run

__all__ = [
    "RECORDING_FORMAT",
    "GradientRecorder",
    "GradientRecording",
    "OfflineRun",
    "compare_recordings",
    "compose_recording_config",
    "cross_worker_cosine",
    "leader_position_statistics",
    "load_recording",
    "pairwise_cosine",
    "pairwise_topk_jaccard",
    "plot_cosine_over_time",
    "plot_topk_jaccard_over_time",
    "random_topk_jaccard",
    "read_offline_run",
    "record_gradients",
    "recording_cosine",
    "recording_topk_jaccard",
    "select_parameters",
    "summarize_recording",
    "topk_jaccard",
]
