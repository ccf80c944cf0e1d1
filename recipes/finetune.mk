# Fine-tune a model that exists (an OPUS-MT MarianMT or a fairseq WMT19 FSMT folder of Transformers) on your
# data: nmt import transformers, nmt prepare --from-model, nmt train --init-from, nmt average, then translate and
# score the test set before and after. Each step is skipped when its output exists.
#
#   make finetune-transformers MODEL_DIR=/path/to/opus-mt-en-de DATA=/path/to/corpus SRC=en TGT=de
#
# DATA holds FT_TRAIN, FT_VALID and FT_TEST as PREFIX.SRC / PREFIX.TGT (.gz too); MODEL_DIR may also be a hub id
# (Helsinki-NLP/opus-mt-en-de) on a machine with internet and huggingface_hub.

MODEL_DIR      ?=
FT_EXP         ?= exp/finetune
FT_TRAIN       ?= $(DATA)/train
FT_VALID       ?= $(DATA)/val
FT_TEST        ?= $(DATA)/test_2016_flickr
TARGET_TOKEN   ?=
FT_MAX_TOKENS  ?= 4096
FT_LR          ?= 5e-5
FT_WARMUP      ?= 500
FT_UPDATES     ?= 2000
FT_SAVE_EVERY  ?= 200
FT_AVERAGE     ?= 5
FT_BEAM        ?= 4
FT_FLAGS       ?=

.PHONY: finetune-transformers
finetune-transformers: $(FT_EXP)/scores.txt

$(FT_EXP)/imported.pt: | install
	@[ -n "$(MODEL_DIR)" ] || { echo "finetune-transformers: give MODEL_DIR=a Transformers folder (or hub id)" >&2; exit 2; }
	@mkdir -p $(FT_EXP)
	$(NMT) import transformers $(MODEL_DIR) -o $@ $(if $(TARGET_TOKEN),--target-token '$(TARGET_TOKEN)')

$(FT_EXP)/data/meta.json: $(FT_EXP)/imported.pt
	$(NMT) prepare --from-model $< --train $(FT_TRAIN) --valid $(FT_VALID) --test $(FT_TEST) --out $(FT_EXP)/data \
	  --force

# A fresh optimizer from the imported weights: warmup to FT_LR, then the inverse square root of eq. 3.
$(FT_EXP)/ckpt/.done: $(FT_EXP)/data/meta.json
	$(NMT) train $(FT_EXP)/data --init-from $(FT_EXP)/imported.pt --save-dir $(FT_EXP)/ckpt --lr $(FT_LR) \
	  --warmup $(FT_WARMUP) --max-updates $(FT_UPDATES) --max-tokens $(FT_MAX_TOKENS) \
	  --save-interval-updates $(FT_SAVE_EVERY) --keep-last $(FT_AVERAGE) --seed 1 $(FT_FLAGS)
	@touch $@

$(FT_EXP)/model.pt: $(FT_EXP)/ckpt/.done
	$(NMT) average $(FT_EXP)/ckpt --last $(FT_AVERAGE) -o $@

$(FT_EXP)/test.before.hyp: $(FT_EXP)/imported.pt $(FT_EXP)/data/meta.json
	$(NMT) translate -m $< -i $(FT_EXP)/data/test.raw.$(SRC) -o $@ --beam $(FT_BEAM)

$(FT_EXP)/test.after.hyp: $(FT_EXP)/model.pt
	$(NMT) translate -m $< -i $(FT_EXP)/data/test.raw.$(SRC) -o $@ --beam $(FT_BEAM)

$(FT_EXP)/scores.txt: $(FT_EXP)/test.before.hyp $(FT_EXP)/test.after.hyp
	@set -e; for when in before after; do echo "$$when fine-tuning:"; \
	  $(NMT) score --ref $(FT_EXP)/data/test.raw.$(TGT) -i $(FT_EXP)/test.$$when.hyp --metrics bleu,chrf --lang $(TGT); \
	done | tee $@.tmp; mv $@.tmp $@
