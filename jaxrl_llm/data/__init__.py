"""The data side of training: tasks, prompts, tokenizers and the verifiers that score answers.

  task.py        `Task`: the one interface the training loop uses, for every kind of task
  tasks/         built-in synthetic tasks (reverse, addition, sort) with in-graph JAX verifiers,
                 their character tokenizer and registry (`get_task`)
  file_task.py   `FileTask`: prompts read from JSONL / Parquet files, scored by host verifiers
  pipeline.py    grain prompt pipeline: example arrays → checkpointable iterator of batches
                 (shuffle, repeat, shard, batch), and `to_prompt_batch` (→ device arrays)
  records.py     JSONL / Parquet records: reading, checking, train/eval split
  prompt_batches.py  records → tokenized, checkpointable iterators of prompt batches
  tokenizers.py  `HFTokenizer`: a Hugging Face ``tokenizer.json`` with its special tokens
  templates.py   named prompt templates and Jinja chat templates
  verifiers/     host verifiers: math answer extraction and equivalence, format rewards, batch
                 scoring in killable worker processes

Nothing is imported here: import the module you need (``from jaxrl_llm.data import pipeline``).
"""
