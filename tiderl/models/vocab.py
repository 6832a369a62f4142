"""The shared word list of the word-level tokenizer that random-init models use.

A random-init model (``tiderl model init``) has one token per word: the specials, the numbers
0..1000, single punctuation marks, and the words below. Text is lower-cased and split on
whitespace and punctuation before lookup; anything else becomes ``<unk>``.

Contract with the environment service: built-in environments (guessing game, web shop,
household game) must only emit words from this list, and numbers from 0 to 1000. A new
environment that needs more words extends :data:`WORDS` here (append only: the ids of existing
words must not move, or saved checkpoints stop matching their tokenizer).
"""

from __future__ import annotations

SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")
PAD, EOS, BOS, UNK = SPECIALS

NUMBERS = tuple(str(n) for n in range(1001))  # includes the digits 0-9

PUNCTUATION = tuple(".,;:!?'\"()[]{}<>-_/\\+*=#$%&@|~`^")

_TEXT = """
a an the this that these those it its i me my you your we our they them their he she his her
is are was were be been being am do does did done have has had having will would can could
shall should may might must not no yes ok okay and or but if then else so because than as
of at by for from with without into onto out up down over under about after before again
more most less least very too also only just all any some none each every both either neither
what which who whom whose when where why how there here now today turn turns step steps
number numbers guess guessed guessing high low higher lower correct wrong right left
between range try tries attempt attempts left remaining win won lose lost game games score
points point reward done start end over new next previous first last try again hint
search searched searching results result page pages click clicked buy bought add cart checkout
item items product products price prices cost costs dollar dollars cheap cheaper expensive
color colour colors size sizes small medium large big bigger smaller extra style brand rating
stars star review reviews option options select selected back description features feature
quantity available stock shop store order ordered pack set pair count weight material
red blue green yellow black white gray grey brown pink purple orange silver gold beige navy
shirt shirts shoe shoes boots dress jacket pants jeans hat bag bags watch phone case cover
cotton leather wool plastic metal wood wooden glass steel men women kids unisex
go goes going went to open opened close closed take took taken put placed in on inside
outside room rooms kitchen bedroom bathroom livingroom hallway garage garden office
cabinet cabinets drawer drawers shelf shelves table tables desk chair chairs sofa couch bed
fridge refrigerator microwave oven stove stoveburner sink sinkbasin toilet bathtub bathtubbasin
countertop counter dresser sidetable diningtable coffeetable armchair safe box boxes
apple apples bread egg eggs lettuce tomato potato knife butterknife fork spoon spatula cup mug
plate bowl pan pot kettle bottle vase book books pen pencil laptop keychain creditcard
cellphone remotecontrol pillow cloth towel soapbar soapbottle candle statue lamp desklamp
floorlamp alarmclock cd newspaper key keys window door light switch
clean cleaned heat heated cool cooled slice sliced use used examine look looked inventory
carrying holding nothing see seeing find found arrive arrived task goal your you're
move moved pick picked drop dropped place wait help please thanks thank sorry error invalid
action actions observation observations answer answers question questions think thought
cannot don didn doesn isn aren wasn weren couldn wouldn shouldn t s re ll ve m d
one two three four five six seven eight nine ten hundred thousand
target secret between lowest highest value values maximum minimum max min
user assistant system tool call calls name names word words say said tell told
north south east west up down around near far top bottom front behind middle
good bad great fine best better worse worst same different other another
time times second seconds minute minutes hour hours day days
""".split()  # noqa: SIM905 (a word list reads better as text than as 500 quoted strings)

# Appended for the built-in environments (append only: new words go at the end of this list).
_TEXT_ENVS = """
anything happens hot id made need query such thing using valid want welcome episode
""".split()  # noqa: SIM905

WORDS: tuple[str, ...] = tuple(dict.fromkeys(
    w for w in (*_TEXT, *_TEXT_ENVS)
    if w not in NUMBERS and not any(c in PUNCTUATION for c in w)))

VOCAB: tuple[str, ...] = (*SPECIALS, *NUMBERS, *PUNCTUATION, *WORDS)

# The tokens that frame an image in a vision model's text (Qwen2-VL's spellings): a ``tiny-vl``
# tokenizer adds them as specials after its own vocabulary, in this order.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
VISION_START, VISION_END, IMAGE_PAD = VISION_TOKENS
