"""What the test modules share (no test module imports another):

- ``attention``: the random builder of ``rel_attention`` calls (``bench.cases.OpCall``, the record
  the benchmarks build too), the eager/Triton calls and the gradients the tests compare;
- ``reference``: float64 references written from the original XLNet (the literal ``rel_shift``
  attention, the original ``_local_perm``);
- ``compare``: the relative error every comparison uses;
- ``models``: twin transformers/xlnet_fast models on the small config, token ids; the weight scale
  (``SCALE``) at which every attention term shows in the outputs and ``assert_visible``, the check
  that a test sees the term it checks;
- ``spy``: which forward ran: the xlnet_fast op's calls with the backend of each, transformers'
  attention core's calls;
- ``pretraining``: the small corpus and the tiny training run (as a config and as a command line);
- ``faults``: fault injection (a flipped byte, a truncated file, a full disk through ``RLIMIT_FSIZE`` in
  a child process) and the one error line a failed command prints.

``tests/conftest.py`` puts ``tests/`` on ``sys.path`` so that ``import helpers`` works under
``--import-mode=importlib``.
"""
