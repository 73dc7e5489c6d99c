"""The stacks GRPO users run around TRL, one adapter module each: what oomguard patches in the training process
for that stack, and the facts it reports about it (the supervisor and the memory model ask for nothing else).

``vllm``: vLLM beside the trainer (TRL's colocate mode). Imported only by ``child/bootstrap.py`` when the stack's
own modules are imported, so a run that never uses it pays nothing.
"""
