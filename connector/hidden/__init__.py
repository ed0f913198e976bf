"""Hidden states out of vLLM's ``extract_hidden_states`` speculative method (no vLLM import).

- ``scheduler.py``: :class:`~.scheduler.HiddenScheduler`, which requests and which step (the
  scheduler's side);
- ``worker.py``: :class:`~.worker.HiddenWorker`, one pack per step over the hidden-state cache,
  delivered to files and to the rank's KV buffer (the worker's side);
- ``files.py``: the safetensors files (:class:`~.files.HiddenFileWriter`,
  :func:`~.files.read_hidden_file`);
- ``reader.py``: reading them back from the producer's KV server
  (:func:`~.reader.load_hidden_states`, :class:`~.reader.HiddenStatesReader`), presenting the
  prompt digest the entry is bound to (``hidden_states_digest``, or :func:`~.reader.prompt_digest`
  of the reader's own token ids).

The facade (:mod:`connector.vllm_connector.connector`) wires the scheduler and worker sides into
vLLM; what they share with the KV path lives in leaf modules (:mod:`connector.integrity`,
:mod:`connector.streams`, :mod:`connector.steps`). What a user reads is exported here.
"""

from ..integrity import DigestMismatch
from .files import read_hidden_file
from .reader import HiddenStatesReader, load_hidden_states, prompt_digest

__all__ = [
    "DigestMismatch",
    "HiddenStatesReader",
    "load_hidden_states",
    "prompt_digest",
    "read_hidden_file",
]
