"""The bundled digits trainer: the reference application of the worker library.

``python -m gpu_resilience_trainer train [flags]`` trains an MLP on the handwritten-digits set
(an ``.npz`` file, read with numpy: the ``trainer`` extra) with every guarantee of
:mod:`gpu_resilience_worker` on, configured by flags; it is what ``make demo`` and the example
DAGs run. It uses the library as any training code does (:class:`~gpu_resilience_worker.loop.ResilientLoop`
and the public modules), and the library never imports it. It ships in the worker's distribution
(``pip install ./worker``, or ``pip install './worker[trainer]'`` for numpy).
"""
