"""A module as a pure function: :class:`~funcmeta.FunctionalModel`
swaps the given tensors into its module and runs it, and knows nothing of tasks; the shadow
trees and the stand-in base class that checkpointing and task batching share
(``shadow``); the thread-local scope of a model's run (``scope``); and the executor protocol
(``executor``) through which task-batched calls are handed to the task executor. It imports
only the core.
"""
