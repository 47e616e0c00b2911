"""Calibration text for activation-aware int4 quantization (`serving/tools/gptq.py`).

About 8 KB (2,200 SmolLM2 tokens) of generic English prose, dialogue, notes
and code in several languages, written for this purpose. It is deliberately
different from the quality-test sample (tests/data/quality_sample.txt):
calibrating on the evaluation text would flatter the quantizer. It is a
Python module, not a data file, so that it ships with the package.
"""

CALIBRATION_TEXT = r'''The old railway bridge over the river was built in 1887 from wrought iron and
local sandstone. For almost a century it carried coal trains from the valley
mines to the harbour, and when the last mine closed the line was abandoned.
Today the bridge is part of a cycling path. On summer weekends families stop
halfway across to watch the kingfishers that nest in the muddy bank below, and
in winter the fog settles so thickly over the water that the far end of the
bridge disappears entirely.

Honeybees communicate the location of food through a behaviour called the
waggle dance. A forager returning to the hive walks in a figure-eight pattern,
and the angle of the straight run relative to vertical tells the other bees the
direction of the flowers relative to the sun. The duration of the run encodes
the distance. Researchers have decoded these dances to map where colonies
gather nectar across an entire city.

Dear Ms. Okafor,
Thank you for your letter of 14 March. I am pleased to confirm that your
application for the research fellowship has been accepted. The fellowship
begins on the first of September and lasts for two years. Please let us know
by the end of the month whether you intend to take up the offer, and do not
hesitate to contact me if you have any questions about housing or travel.
Kind regards,
Daniel Weber

User: Can you explain what a hash table is?
Assistant: A hash table stores key-value pairs. It uses a hash function to turn
each key into an index in an array of buckets, so looking up, inserting or
deleting a key takes constant time on average. When two keys land in the same
bucket, the table resolves the collision, for example by keeping a short list
in each bucket or by probing for the next free slot.

User: How do I keep basil fresh?
Assistant: Trim the stems, put the bunch in a glass of water like flowers, and
leave it on the counter away from direct sun. Basil turns black in the fridge
because it does not like the cold.

class LRUCache:
    """A least-recently-used cache with a fixed capacity."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.items = collections.OrderedDict()

    def get(self, key):
        if key not in self.items:
            return None
        self.items.move_to_end(key)
        return self.items[key]

    def put(self, key, value):
        self.items[key] = value
        self.items.move_to_end(key)
        if len(self.items) > self.capacity:
            self.items.popitem(last=False)

function debounce(fn, waitMs) {
  let timer = null;
  return (...args) => {
    clearTimeout(timer);
    timer = setTimeout(() => fn.apply(this, args), waitMs);
  };
}

const input = document.querySelector("#search");
input.addEventListener("input", debounce((event) => {
  fetch(`/api/search?q=${encodeURIComponent(event.target.value)}`)
    .then((response) => response.json())
    .then((results) => render(results));
}, 250));

#!/usr/bin/env bash
set -euo pipefail
for file in logs/*.log; do
  count=$(grep -c "ERROR" "$file" || true)
  echo "$file: $count errors"
done | sort -t: -k2 -n -r | head -n 10

## Installation

1. Clone the repository and change into its directory.
2. Create a virtual environment: `python -m venv .venv`.
3. Install the dependencies with `pip install -r requirements.txt`.
4. Run the tests with `pytest -q` before opening a pull request.

The Industrial Revolution began in Britain in the second half of the eighteenth
century. Steam engines, first used to pump water out of mines, were soon
driving looms and locomotives. Cities grew quickly as workers moved from the
countryside to the factories, and living conditions in the crowded new towns
were often poor. Reformers campaigned for shorter working hours, for schools,
and for clean water, and by the end of the nineteenth century many of their
demands had become law.

To change a flat tyre on a bicycle, first shift to the smallest rear cog and
open the brake. Remove the wheel, push one side of the tyre off the rim with
tyre levers, and pull out the inner tube. Find the hole by pumping a little air
into the tube and listening, then either patch it or fit a new tube. Check the
inside of the tyre for thorns before putting everything back together.

The mitochondrion is often called the powerhouse of the cell. It produces most
of the cell's supply of adenosine triphosphate, which is used as a source of
chemical energy. Mitochondria have their own small circular genome, which is
inherited almost exclusively from the mother, and this makes them useful for
tracing human ancestry over many generations.

struct Point {
    double x;
    double y;
};

double distance(const Point& a, const Point& b) {
    double dx = a.x - b.x;
    double dy = a.y - b.y;
    return std::sqrt(dx * dx + dy * dy);
}

import numpy as np

def moving_average(values, window=5):
    """Returns the moving average of a 1-D array."""
    kernel = np.ones(window) / window
    return np.convolve(values, kernel, mode="valid")

data = np.random.default_rng(7).normal(size=100)
print(moving_average(data)[:3])

Question: A train travels 180 kilometres in two and a half hours. What is its
average speed?
Answer: The average speed is the distance divided by the time: 180 km divided
by 2.5 h gives 72 kilometres per hour.

Question: Why is the sky blue?
Answer: Sunlight is scattered by the molecules in the air, and shorter
wavelengths are scattered much more strongly than longer ones. Blue light is
therefore spread across the whole sky, while the sun itself looks slightly
yellow.

{"id": 4182, "name": "Ada", "roles": ["admin", "editor"], "active": true,
 "last_login": "2025-06-03T09:41:12Z", "preferences": {"theme": "dark"}}

Every spring the village holds a market in the square in front of the town
hall. Farmers bring cheese, honey and early vegetables, a brass band plays on
the steps, and children race wooden boats in the fountain. The market has taken
place every year since 1902, except for the two years of the war, and some of
the stalls have been run by the same families for four generations.

Good software documentation answers three questions: what does this do, how do
I use it, and what happens when something goes wrong. Short examples that can
be copied and run are worth more than long explanations, and every example
should be tested so that it does not silently go out of date when the code
changes.

A good night's sleep depends less on the number of hours than on keeping a
regular rhythm. Going to bed and getting up at the same time every day, even at
weekends, helps the body's internal clock. Bright light in the morning, a cool
and dark bedroom, and putting screens away an hour before bed all make it
easier to fall asleep. Caffeine stays in the blood for many hours, so a coffee
after lunch can still keep someone awake at midnight.

SELECT department, AVG(salary) AS average_salary, MAX(hired_on) AS latest_hire
FROM employees
WHERE status = 'active'
GROUP BY department
HAVING COUNT(*) > 3
ORDER BY average_salary DESC;

package main

import (
	"fmt"
	"strings"
)

func wordCount(text string) map[string]int {
	counts := make(map[string]int)
	for _, word := range strings.Fields(strings.ToLower(text)) {
		counts[word]++
	}
	return counts
}

func main() {
	fmt.Println(wordCount("the cat and the hat"))
}

The Great Barrier Reef stretches for more than two thousand kilometres along
the north-eastern coast of Australia. It is made of billions of tiny animals
called coral polyps, which build hard skeletons of calcium carbonate. When the
sea becomes too warm, the corals expel the algae that live inside them and give
them their colour, and large parts of the reef turn white. Scientists call this
bleaching, and they watch it closely because a reef that bleaches too often has
no time to recover.

User: What is the difference between a list and a tuple in Python?
Assistant: Both hold an ordered sequence of items. A list is mutable, so you can
append, remove or change its elements after creating it; a tuple is immutable,
which makes it hashable when its items are, so it can be used as a dictionary
key or stored in a set.

Meeting notes, Tuesday: the team agreed to move the release to the second week
of May. Priya will finish the migration script, Tom will update the user guide,
and everyone will review the open bug reports before Friday. The next meeting
is on Thursday at ten o'clock in the small conference room.
'''
