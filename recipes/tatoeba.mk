# Tatoeba Mandarin<->English on CPU (manythings.org's cmn-eng pairs, CC-BY 2.0 France; see
# ../shared/data/tatoeba-cmn-eng/SOURCE.md): split, nmt prepare --tokenizer sentencepiece, nmt train (small,
# bf16, a time budget), choose on valid, translate and score test (sacreBLEU's zh tokenizer into Chinese).
# Every step writes its output atomically and is skipped when that output exists, so a run resumes.
#
#   make tatoeba-zh-en                     # DATA defaults to ../shared/data/tatoeba-cmn-eng, else downloads
#   make tatoeba-en-zh DATA=/path/to/dir   # a local copy: DIR/cmn.txt or DIR/cmn.txt.gz
#   make tatoeba-zh-en TOKENIZER=moses     # the paper's Moses + joint BPE pipeline on the same split
#   make tatoeba-zh-en LINES=2000 TRAIN_MINUTES=1 EXP=exp/tatoeba-smoke   # a quick smoke run
#
# The variables the Multi30k recipe also reads (DATA, EXP, LINES, TRAIN_MINUTES, ARCH, ...) take their values
# here only when given on the command line or in the environment; otherwise this recipe's own defaults apply.

TATOEBA_URL := https://www.manythings.org/anki/cmn-eng.zip
# $(call given,NAME,DEFAULT): NAME's value when the user set it, else DEFAULT (not the Multi30k recipe's default)
given = $(if $(filter command line environment environment override,$(origin $1)),$($1),$2)

T_DATA      := $(call given,DATA,$(wildcard ../shared/data/tatoeba-cmn-eng))
T_ROOT      := $(call given,EXP,exp/tatoeba)
T_LINES     := $(call given,LINES,)
T_MINUTES   := $(call given,TRAIN_MINUTES,30)
T_UPDATES   := $(call given,MAX_UPDATES,0)
T_ARCH      := $(call given,ARCH,small)
T_PRECISION := $(call given,PRECISION,auto)
T_TOKENIZER := $(call given,TOKENIZER,sentencepiece)
# 8,000 shared pieces for ~23k pairs (WMT's 32-37k is for millions); BPE on Moses words gets as many merges.
# A smoke run on LINES= pairs gets 3,000 (a few thousand lines cannot fill 8,000 SentencePiece pieces).
T_VOCAB     := $(call given,VOCAB_SIZE,$(if $(T_LINES),3000,8000))
T_MERGES    := $(call given,BPE_MERGES,$(if $(T_LINES),3000,8000))
T_BEAM      := $(call given,BEAM,4)
T_LENPENS   := $(call given,LENPENS,0.6 1.0 1.4)
T_WINDOWS   := $(call given,AVERAGE_WINDOWS,3 5 8 10)
T_FLAGS     := $(call given,TRAIN_FLAGS,)

T_RAW = $(T_ROOT)/raw$(if $(T_LINES),-$(T_LINES))
# Set by tatoeba-zh-en / tatoeba-en-zh for the inner make:
T_EXP = $(T_ROOT)/$(T_SRC)-$(T_TGT)-$(T_TOKENIZER)$(if $(T_LINES),-$(T_LINES))

.PHONY: tatoeba-zh-en tatoeba-en-zh tatoeba-data tatoeba-run
tatoeba-zh-en tatoeba-en-zh: tatoeba-%: | install
	@case "$(T_TOKENIZER)" in moses|sentencepiece) ;; \
	  *) echo "tatoeba: TOKENIZER must be moses or sentencepiece (got '$(T_TOKENIZER)')" >&2; exit 2;; esac
	@$(MAKE) --no-print-directory tatoeba-run T_SRC=$(word 1,$(subst -, ,$*)) T_TGT=$(word 2,$(subst -, ,$*))

# --- data: cmn.txt(.gz) from DATA, or manythings.org's zip; split once for both directions and tokenizers.
$(T_RAW)/split.json: | install
	@mkdir -p $(T_RAW)
	@set -e; if [ -n "$(T_DATA)" ]; then \
	  src=$(T_DATA)/cmn.txt; [ -f $$src ] || src=$$src.gz; \
	  [ -f $$src ] || { echo "tatoeba: $(T_DATA)/cmn.txt(.gz): no such file (DATA=$(T_DATA))" >&2; exit 2; }; \
	else \
	  echo "downloading $(TATOEBA_URL)"; \
	  curl -fsSL $(TATOEBA_URL) -o $(T_RAW)/cmn-eng.zip.tmp && mv $(T_RAW)/cmn-eng.zip.tmp $(T_RAW)/cmn-eng.zip; \
	  (cd $(T_RAW) && unzip -o -q cmn-eng.zip cmn.txt); src=$(T_RAW)/cmn.txt; \
	fi; \
	$(BIN)/python recipes/tatoeba_split.py --input $$src --out $(T_RAW) $(if $(T_LINES),--lines $(T_LINES))
tatoeba-data: $(T_RAW)/split.json

tatoeba-run: $(T_EXP)/score.json

$(T_EXP)/data/meta.json: $(T_RAW)/split.json
	$(NMT) prepare -s $(T_SRC) -t $(T_TGT) --train $(T_RAW)/train --valid $(T_RAW)/valid --test $(T_RAW)/test \
	  --tokenizer $(T_TOKENIZER) --vocab-size $(T_VOCAB) --bpe-merges $(T_MERGES) --out $(T_EXP)/data --force

$(T_EXP)/ckpt/.done: $(T_EXP)/data/meta.json
	$(NMT) train $(T_EXP)/data --save-dir $(T_EXP)/ckpt --arch $(T_ARCH) --precision $(T_PRECISION) \
	  --max-tokens 4096 --lr-scale 0.5 --warmup 1000 --max-time $(T_MINUTES) --max-updates $(T_UPDATES) --cooldown 0.3 \
	  --attention-dropout 0.1 --activation-dropout 0.1 --keep-last 10 --seed 1 --device cpu $(T_FLAGS)
	@touch $@

$(T_EXP)/model.pt: $(T_EXP)/ckpt/.done
	$(BIN)/python recipes/select_on_val.py --ckpt-dir $(T_EXP)/ckpt --src $(T_EXP)/data/valid.raw.$(T_SRC) \
	  --ref $(T_EXP)/data/valid.raw.$(T_TGT) --windows "$(T_WINDOWS)" --lenpens "$(T_LENPENS)" --beam $(T_BEAM) \
	  --out $@ --record $(T_EXP)/selection.json

$(T_EXP)/test.hyp: $(T_EXP)/model.pt
	$(NMT) translate -m $< -i $(T_EXP)/data/test.raw.$(T_SRC) -o $@  # with the beam and length penalty chosen on val

# Scored with the target language's tokenizer (sacreBLEU's zh into Chinese, 13a into English), read from the model.
$(T_EXP)/score.json: $(T_EXP)/test.hyp
	$(NMT) score -m $(T_EXP)/model.pt --ref $(T_EXP)/data/test.raw.$(T_TGT) -i $< --metrics bleu,chrf
	@$(NMT) score -m $(T_EXP)/model.pt --ref $(T_EXP)/data/test.raw.$(T_TGT) -i $< --metrics bleu,chrf --json \
	  > $@.tmp && mv $@.tmp $@
