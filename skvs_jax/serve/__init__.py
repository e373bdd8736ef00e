"""Serving a real model: the engine drives the scheduler and a model through one jitted step.

  llm           `LLM`: vLLM's offline front (checkpoint folder in, text and `RequestOutput`s out, streaming)
  outputs       `RequestOutput`, `CompletionOutput`, `Logprob`, `RequestMetrics`: what `LLM` returns
  async_llm     `AsyncLLM`: an asyncio front over one `LLM`, its engine on a thread of its own (servers)
  openai_server the OpenAI-compatible HTTP server over an `AsyncLLM` (FastAPI; `skvs serve`)
  engine        `Engine`: requests in, tokens out; the device state and the host loop around one jitted step
  options       `EngineOptions`: the engine's options, one frozen validated dataclass; the draft tree's checks
  requests      the request table: logs, queue, slots, n > 1 forks, aborts (host only); `RequestLog`
  widths        the width picker: each step's query width, the histograms, the draft widths' re-choice
  step_cost     the engine's step cost, fitted from timed steps of its compiled programs
  engine_step   the jitted step itself, as named phases (schedule, drafts, forward, verify, update)
  dispatch      many engine steps in one jitted program (`run_steps`): the loop, the device's width pick, its
                admissions of the requests the host staged, the rules that end a dispatch where the host is needed
  sampling      per-request sampling inside the step: logits processing, streams, stop sequences, logprobs
  sampling_params  `SamplingParams`: what a request asks of the sampler, validated at the boundary
  constraints   allowed_token_ids, bad_words, min_tokens and logit_bias as one additive term on the logits
  model_runner  the protocol the engine reaches models through, and the tiny Llama + Medusa runner
  oracle_drafter  drafts of a chosen acceptance (a corrupted reference continuation) for models without heads
  speculation   draft trees, verification over a tree, the accepted path's KV move
  acceptance    the acceptance rules (greedy, typical, lossless rejection sampling) and a chi-square test
  tokenizer     text in and out: the byte and Hugging Face tokenizers, chat templates, streaming decode,
                stop strings matched exactly on token ids
"""
