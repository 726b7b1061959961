"""Word lists used by the semantic-cache guard (guard.py).

Lists are deliberately general (everyday English, common technical vocabulary);
they describe the kinds of words whose change flips an answer, not particular
questions.
"""

from __future__ import annotations

NEGATIONS = frozenset(
    """
not no never none nobody nothing neither nor cannot cant dont doesnt didnt isnt arent wasnt werent
wont wouldnt shouldnt couldnt hasnt havent hadnt mustnt without nowhere
nicht kein keine nie niemals pas jamais aucun sans nunca ningún ninguna sin non mai
""".split()
)

# Each line is one group of opposites; words on the same side are separated by "/".
# A query mentioning one side and a cached query mentioning another side of the same
# group ask different things ("enable" vs "disable", "open" vs "closed").
_ANTONYM_GROUPS = """
open/opened | close/closed/shut
enable/enabled/activate/turn on | disable/disabled/deactivate/turn off
on | off
allow/allowed/permit/whitelist | deny/denied/block/blocked/forbid/blacklist/prohibit
increase/raise/grow/more/higher/larger/bigger/greater/maximum/max/most/longest/largest/biggest/highest/upper | decrease/reduce/lower/shrink/less/fewer/smaller/minimum/min/least/shortest/smallest/lowest
add/insert/append/create | remove/delete/drop/erase/destroy
install | uninstall
start/begin/launch | stop/end/halt/finish/kill/terminate
before/earlier/prior | after/later
upload | download
import | export
push | pull
send/sent | receive/received
encrypt | decrypt
compress/zip | decompress/unzip/extract
serialize/encode | deserialize/decode/parse
lock | unlock
public | private
input/stdin | output/stdout
left | right
up/upward | down/downward
above | below
inside/internal | outside/external
first/earliest | last/latest
login/log in/sign in/signin | logout/log out/sign out/signout
subscribe | unsubscribe/cancel
include/including | exclude/excluding
connect | disconnect
show/display | hide
accept/approve | reject/decline/refuse
buy/purchase | sell
true | false
positive | negative
sync/synchronous/synchronously | async/asynchronous/asynchronously
ascending/asc | descending/desc
read | write
client | server
cheap/cheapest/cheaper | expensive/costly
fast/faster/fastest/quick | slow/slower/slowest
hot/warm | cold/cool
win | lose
mount | unmount
north | south
east | west
import | export
deposit | withdraw/withdrawal
charge/charged | refund/refunded
valid | invalid
success/succeed/successful | failure/fail/failed
online | offline
static | dynamic
mutable | immutable
visible | invisible/hidden
debit | credit
inbound/incoming/ingress | outbound/outgoing/egress
with | without
"""

ANTONYM_INDEX: dict[str, tuple[int, int]] = {}
for _gid, _line in enumerate(l for l in _ANTONYM_GROUPS.strip().splitlines() if l.strip()):
    for _side, _words in enumerate(_line.split("|")):
        for _w in _words.split("/"):
            _w = _w.strip()
            if _w and " " not in _w:
                ANTONYM_INDEX.setdefault(_w, (_gid, _side))

NUMBER_WORDS = {
    "zero": "0",
    "one": "1",
    "two": "2",
    "three": "3",
    "four": "4",
    "five": "5",
    "six": "6",
    "seven": "7",
    "eight": "8",
    "nine": "9",
    "ten": "10",
    "eleven": "11",
    "twelve": "12",
    "thirteen": "13",
    "fourteen": "14",
    "fifteen": "15",
    "sixteen": "16",
    "seventeen": "17",
    "eighteen": "18",
    "nineteen": "19",
    "twenty": "20",
    "thirty": "30",
    "forty": "40",
    "fifty": "50",
    "sixty": "60",
    "seventy": "70",
    "eighty": "80",
    "ninety": "90",
    "hundred": "100",
    "thousand": "1000",
    "million": "1000000",
    "billion": "1000000000",
    "dozen": "12",
    "half": "0.5",
    "quarter": "0.25",
    "double": "x2",
    "twice": "x2",
    "triple": "x3",
    "thrice": "x3",
    "second": "2",
    "third": "3",
    "fourth": "4",
    "fifth": "5",
    "sixth": "6",
    "seventh": "7",
    "eighth": "8",
    "ninth": "9",
    "tenth": "10",
}

_UNIT_GROUPS = """
b byte bytes
kb kilobyte kilobytes kib
mb megabyte megabytes mib
gb gigabyte gigabytes gib gig gigs
tb terabyte terabytes tib
bit bits
kbps mbps gbps
ms millisecond milliseconds msec
µs μs us microsecond microseconds
ns nanosecond nanoseconds
sec secs second seconds
min mins minute minutes
h hr hrs hour hours
day days
week weeks
month months
year years yr yrs
mm millimeter millimeters millimetre millimetres
cm centimeter centimeters centimetre centimetres
m meter meters metre metres
km kilometer kilometers kilometre kilometres kms
in inch inches
ft foot feet
yd yard yards
mi mile miles
mph
kmh kph
g gram grams
kg kilo kilos kilogram kilograms
mg milligram milligrams
lb lbs pound pounds
oz ounce ounces
l liter liters litre litres
ml milliliter milliliters millilitre millilitres
gal gallon gallons
°c celsius centigrade
°f fahrenheit
k kelvin
% percent percentage
$ usd dollar dollars
€ eur euro euros
£ gbp
¥ jpy yen
px pixel pixels
em
rem
dpi
hz hertz
khz kilohertz
mhz megahertz
ghz gigahertz
w watt watts
kw kilowatt kilowatts
kwh
v volt volts
a amp amps ampere amperes
mah
rpm
cpu cpus core cores vcpu vcpus
thread threads
"""

UNITS: dict[str, str] = {}
for _line in _UNIT_GROUPS.strip().splitlines():
    _names = _line.split()
    for _n in _names:
        UNITS.setdefault(_n, _names[0])
# "second"/"minute" double as ordinals/verbs; keep them as units only when plural or abbreviated.
for _ambiguous in ("second", "in", "a", "m", "us", "min", "k", "g", "l", "b", "v", "w", "h", "em", "rem"):
    UNITS.pop(_ambiguous, None)

DATE_WORDS = {}
for _i, _names in enumerate(
    """
january jan | february feb | march mar | april apr | may | june jun | july jul | august aug |
september sep sept | october oct | november nov | december dec
""".replace("\n", " ").split("|")
):
    for _n in _names.split():
        DATE_WORDS[_n] = f"month{_i + 1}"
for _i, _names in enumerate(
    "monday mon | tuesday tue tues | wednesday wed | thursday thu thurs | "
    "friday fri | saturday sat | sunday sun".split("|")
):
    for _n in _names.split():
        DATE_WORDS[_n] = f"weekday{_i + 1}"
for _n in (
    "today",
    "tonight",
    "tomorrow",
    "yesterday",
    "weekend",
    "weekday",
    "weekdays",
    "morning",
    "afternoon",
    "evening",
    "night",
    "midnight",
    "noon",
    "spring",
    "summer",
    "autumn",
    "fall",
    "winter",
    "now",
    "currently",
    "ago",
    "next",
    "previous",
):
    DATE_WORDS[_n] = _n
DATE_WORDS.pop("may", None)  # modal verb far more often than the month
DATE_WORDS.pop("sat", None)
DATE_WORDS.pop("sun", None)
DATE_WORDS.pop("mar", None)
DATE_WORDS.pop("fall", None)
DATE_WORDS.pop("dec", None)

STOPWORDS = {
    "en": frozenset(
        "the a an is are was were what how why when where who which do does did can could "
        "should would i you my your it this that of to in on for with and or be have has".split()
    ),
    "de": frozenset(
        "der die das ist sind war wie was warum wann wo wer welche ich du mein dein es ein eine "
        "und oder mit für von zu auf nicht kann können ich wird werden".split()
    ),
    "fr": frozenset(
        "le la les est sont était comment quoi pourquoi quand où qui quel quelle je tu mon ton "
        "il elle un une et ou avec pour de du des dans sur pas peut puis ce cette".split()
    ),
    "es": frozenset(
        "el la los las es son era cómo como qué que por porqué cuándo dónde quién cuál yo tu mi "
        "un una y o con para de del en sobre no puedo puede este esta".split()
    ),
    "it": frozenset(
        "il lo la gli le è sono era come cosa perché quando dove chi quale io tu mio un una e o "
        "con per di del in su non posso può questo questa".split()
    ),
    "pt": frozenset(
        "o a os as é são era como que porque quando onde quem qual eu tu meu um uma e ou com "
        "para de do da em sobre não posso pode este esta".split()
    ),
    "nl": frozenset(
        "de het een is zijn was hoe wat waarom wanneer waar wie welke ik jij mijn en of met voor "
        "van naar op niet kan kunnen dit deze".split()
    ),
}

# Capitalised words that are not names: sentence-internal "I", shouting, titles of common things.
COMMON_CAPS = frozenset(
    """
i i'm i've i'd i'll ok okay hi hello hey please thanks thank faq vs etc e.g i.e
""".split()
)
