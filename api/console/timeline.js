// The reservations timeline (a Gantt chart per atom over now ± a day, zoomable), the booked
// capacity over time, and the reserve form. The chart redraws when `reservation.*` events
// arrive over the live stream, never after the form's own answer, so what appears is what the
// server published.

import { gql, mutate, newKey } from './api.js';
import { h, clear, fmtTime, fmtSpan, toLocalInput, errorText, toast, virtualList, areaChart } from './ui.js';

const SPANS = [3, 6, 12, 24, 48, 168].map((hours) => hours * 3600e3);
const ROW = 24;
const LIVE_STATES = ['PENDING', 'SCHEDULED', 'ACTIVE'];
/// Pools up to this many nodes show a row for every atom; larger ones show the booked atoms
/// (listing 8,000 free rows would cost a minute's query budget and help nobody).
const ALL_ROWS_UP_TO = 100;

async function allPages(name, variables, pick, limit = 2000) {
  const out = [];
  let after = null;
  for (;;) {
    const data = await gql(name, { ...variables, after });
    const c = pick(data);
    out.push(...c.nodes);
    if (!c.pageInfo.hasNextPage || out.length >= limit) return out;
    after = c.pageInfo.endCursor;
  }
}

export function timelineView(root, ctx) {
  const pools = ctx.pools();
  const state = {
    poolId: ctx.prefs.poolId || (pools[0] && pools[0].id),
    span: ctx.prefs.span || 24 * 3600e3,
    center: Date.now(),
    selected: null,
  };
  const poolSelect = h('select', { id: 'timeline-pool' }, pools.map((p) => h('option', { value: p.id, selected: p.id === state.poolId }, `${p.siteName} / ${p.name}`)));
  const spanLabel = h('span', { class: 'muted' });
  const range = h('span', { id: 'timeline-range' });
  const chart = h('div', { id: 'timeline', class: 'gantt' });
  const capacity = h('div', { class: 'panel', id: 'capacity-chart' });
  const pending = h('div', { id: 'pending' });
  const details = h('div', { id: 'details', class: 'panel' }, h('p', { class: 'muted' }, 'Click a reservation for its details, or a free stretch of a row to reserve it.'));
  const form = reserveForm(ctx, { compact: true });
  const button = (label, title, f) => h('button', { type: 'button', title, onclick: f }, label);
  clear(root,
    h('div', { class: 'toolbar' },
      h('h1', {}, 'Timeline'), h('label', {}, 'Pool ', poolSelect),
      button('◀', 'Earlier', () => { state.center -= state.span / 2; load(); }),
      button('Now', 'Centre on now', () => { state.center = Date.now(); load(); }),
      button('▶', 'Later', () => { state.center += state.span / 2; load(); }),
      button('−', 'Zoom out', () => zoom(1)), button('+', 'Zoom in', () => zoom(-1)),
      spanLabel, range),
    h('div', { class: 'columns' },
      h('div', {}, h('h2', {}, 'Whole GPUs booked over time'), capacity, chart, h('h2', {}, 'Pending (not placed yet)'), pending),
      h('aside', {}, h('h2', {}, 'Reserve'), form.element, h('h2', {}, 'Details'), details)));
  poolSelect.addEventListener('change', () => {
    state.poolId = poolSelect.value;
    ctx.prefs.poolId = state.poolId;
    form.setPool(state.poolId);
    load();
  });
  form.setPool(state.poolId);

  function zoom(dir) {
    const i = SPANS.indexOf(state.span);
    state.span = SPANS[Math.max(0, Math.min(SPANS.length - 1, (i < 0 ? 3 : i) + dir))];
    ctx.prefs.span = state.span;
    load();
  }

  let atomsOf = {};
  let loading = null;
  let again = false;
  async function load() {
    if (loading) {
      again = true;
      return loading;
    }
    loading = (async () => {
      try {
        do {
          again = false;
          await draw();
        } while (again);
      } catch (e) {
        clear(chart, h('p', { class: 'error' }, errorText(e)));
      } finally {
        loading = null;
      }
    })();
    return loading;
  }

  async function draw() {
    if (!state.poolId) {
      clear(chart, h('p', { class: 'muted' }, 'No pools yet.'));
      return;
    }
    const from = state.center - state.span;
    const to = state.center + state.span;
    spanLabel.textContent = `± ${fmtSpan(state.span)}`;
    range.textContent = `${fmtTime(new Date(from).toISOString())} → ${fmtTime(new Date(to).toISOString())}`;
    if (!atomsOf[state.poolId]) {
      // Nodes are for operators; a member's timeline shows the atoms its reservations hold.
      const page = ctx.isOperator()
        ? (await gql('ConsolePoolAtoms', { poolId: state.poolId, first: ALL_ROWS_UP_TO })).computeNodes
        : { totalCount: null, nodes: [] };
      const atoms = [];
      const all = page.totalCount !== null && page.totalCount <= ALL_ROWS_UP_TO;
      if (all) {
        for (const n of page.nodes) {
          n.devices.forEach((d, i) => {
            d.atoms.forEach((a, j) => {
              const label = `${n.hostname} · ${d.model.split('-')[0]} #${i}${a.kind === 'GPU' ? '' : ` ${a.kind.toLowerCase()} ${j}`}`;
              atoms.push({ name: a.name, kind: a.kind, model: d.model, hostname: n.hostname, label });
            });
          });
        }
      }
      const pool = ctx.pools().find((p) => p.id === state.poolId);
      const total = (pool ? pool.capacity : []).reduce((n, c) => n + c.total, 0);
      atomsOf = { [state.poolId]: { atoms, all, nodes: page.totalCount, total } };
    }
    const known = atomsOf[state.poolId];
    const window = { start: new Date(from).toISOString(), end: new Date(to).toISOString() };
    const reservations = await allPages('ConsoleReservations', { poolId: state.poolId, window, first: 100 }, (d) => d.reservations);
    // A large pool's rows are the atoms booked in view, named from the allocations.
    let atoms = known.atoms;
    if (!known.all) {
      const seen = new Map();
      for (const r of reservations) {
        for (const a of r.allocations) {
          for (const name of a.atoms) {
            if (!seen.has(name)) {
              const host = a.computeNode ? a.computeNode.hostname : (a.computeNodeId || '?').slice(-8);
              seen.set(name, { name, kind: a.gpuKind, model: a.model, hostname: host, label: `${host} · ${name.replace(/^GPU-/, '').slice(-12)}` });
            }
          }
        }
      }
      atoms = [...seen.values()].sort((x, y) => x.label.localeCompare(y.label, undefined, { numeric: true }));
    }
    const byAtom = new Map();
    const placed = [];
    for (const r of reservations) {
      if (!LIVE_STATES.includes(r.state) && r.state !== 'RELEASED' && r.state !== 'EXPIRED') continue;
      for (const a of r.allocations) {
        for (const atom of a.atoms) {
          if (!byAtom.has(atom)) byAtom.set(atom, []);
          byAtom.get(atom).push(r);
          placed.push({ r, atom });
        }
      }
    }
    // Rows with bookings first, then the free ones.
    const rows = [...atoms].sort((a, b) => (byAtom.has(b.name) ? 1 : 0) - (byAtom.has(a.name) ? 1 : 0));
    const pct = (t) => Math.max(0, Math.min(100, (100 * (t - from)) / (to - from)));
    const nowPct = pct(Date.now());
    const count = new Set(placed.map((p) => p.r.id)).size;
    const inView = `${count} reservation${count === 1 ? '' : 's'} in view`;
    const heading = known.all
      ? `${atoms.length} atoms · ${inView}`
      : `${atoms.length} booked atoms of ${known.total}${known.nodes === null ? '' : ` (${known.nodes} nodes)`} · ${inView}`;
    const axis = h('div', { class: 'gantt-axis' }, h('span', { class: 'gantt-label', title: known.all ? '' : 'A pool of more than 100 nodes lists the atoms booked in view; every atom is free where no row shows it.' }, heading),
      h('span', { class: 'gantt-track' }, ticks(from, to)));
    const list = virtualList(rows, ROW, (atom) => {
      const track = h('span', { class: 'gantt-track', dataset: { atom: atom.name } });
      const now = h('span', { class: 'gantt-now' });
      now.style.left = `${nowPct}%`;
      track.append(now);
      for (const r of byAtom.get(atom.name) || []) {
        const start = Date.parse(r.startsAt);
        const end = Date.parse(r.endsAt);
        const bar = h('span', {
          class: `gantt-bar ${r.state.toLowerCase()}${state.selected === r.id ? ' selected' : ''}`,
          title: `${r.id} ${r.state} ${fmtTime(r.startsAt)} → ${fmtTime(r.endsAt)} (${r.tenantId})`,
          dataset: { reservation: r.id, state: r.state },
        }, r.id.slice(-6));
        bar.style.left = `${pct(start)}%`;
        bar.style.width = `${Math.max(0.4, pct(end) - pct(start))}%`;
        bar.addEventListener('click', (e) => {
          e.stopPropagation();
          state.selected = r.id;
          showDetails(r);
        });
        track.append(bar);
      }
      track.addEventListener('click', (e) => {
        const box = track.getBoundingClientRect();
        let t = from + ((e.clientX - box.left) / box.width) * (to - from);
        t = Math.max(Date.now(), Math.round(t / 900e3) * 900e3);
        form.prefill({ poolId: state.poolId, kind: atom.kind, model: atom.model, start: new Date(t), hours: 1 });
        toast(`Reserve ${atom.kind === 'GPU' ? 'a' : 'an'} ${atom.model} ${atom.kind} from ${fmtTime(new Date(t).toISOString())}: the form is filled in.`);
      });
      return h('div', { class: 'gantt-row' }, h('span', { class: 'gantt-label mono', title: atom.name }, atom.label), track);
    }, 560);
    clear(chart, axis, list);
    // Whole GPUs booked over time, as the server counts them for every tenant (capacityTimeline:
    // counts only, so a member sees the pool's load without seeing whose).
    const stepSeconds = Math.max(60, Math.ceil((to - from) / 96 / 1000));
    const timeline = (await gql('ConsoleCapacity', {
      poolId: state.poolId, from: new Date(from).toISOString(), to: new Date(to).toISOString(), stepSeconds,
    })).capacityTimeline;
    const points = timeline.steps.map((s) => ({ t: Date.parse(s.startsAt), v: s.booked }));
    const total = timeline.steps.length ? timeline.steps[0].total : 0;
    capacity.dataset.total = total;
    capacity.dataset.maxBooked = Math.max(0, ...timeline.steps.map((s) => s.booked));
    const nowStep = timeline.steps.find((s) => Date.parse(s.startsAt) <= Date.now() && Date.now() < Date.parse(s.startsAt) + stepSeconds * 1000);
    capacity.title = nowStep ? `Now: ${nowStep.booked} booked, ${nowStep.free} free, ${nowStep.unavailable} unavailable of ${total} whole GPUs` : '';
    clear(capacity, areaChart(points, total, from, to));
    const waiting = reservations.filter((r) => r.state === 'PENDING');
    clear(pending, waiting.length ? waiting.map((r) => h('div', { class: 'pending-row', dataset: { reservation: r.id } },
      h('button', { type: 'button', class: 'link', onclick: () => showDetails(r) }, r.id), ` ${fmtTime(r.startsAt)} → ${fmtTime(r.endsAt)} `,
      conditionText(r))) : h('p', { class: 'muted' }, 'None.'));
    if (state.selected) {
      const r = reservations.find((x) => x.id === state.selected);
      if (r) showDetails(r);
    }
  }

  function showDetails(r) {
    const actions = [];
    if (LIVE_STATES.includes(r.state)) {
      actions.push(h('button', {
        type: 'button', id: 'extend', onclick: () => act('ConsoleExtendReservation', {
          // One key per intent: extending this version to this end, so a double click replays.
          id: r.id, endsAt: new Date(Date.parse(r.endsAt) + 3600e3).toISOString(), idempotencyKey: `console-extend-${r.id}-v${r.version}`,
        }, 'extended by an hour'),
      }, 'Extend 1 h'));
    }
    if (r.state === 'ACTIVE') actions.push(h('button', { type: 'button', id: 'release', onclick: () => act('ConsoleReleaseReservation', { id: r.id, version: r.version }, 'released') }, 'Release'));
    if (r.state === 'PENDING' || r.state === 'SCHEDULED') actions.push(h('button', { type: 'button', id: 'cancel', class: 'danger', onclick: () => act('ConsoleCancelReservation', { id: r.id, version: r.version }, 'cancelled') }, 'Cancel'));
    clear(details,
      h('dl', {},
        h('dt', {}, 'Reservation'), h('dd', { class: 'mono' }, r.id),
        h('dt', {}, 'State'), h('dd', {}, h('span', { class: `badge ${r.state.toLowerCase()}` }, r.state)),
        h('dt', {}, 'Tenant'), h('dd', {}, r.tenantId),
        h('dt', {}, 'When'), h('dd', {}, `${fmtTime(r.startsAt)} → ${fmtTime(r.endsAt)}`),
        h('dt', {}, 'Holds'), h('dd', {}, r.allocations.map((a) => h('div', { class: 'allocation' }, `${a.gpuCount}× ${a.model || 'any'} ${a.gpuKind}${a.profile ? ` ${a.profile}` : ''}`,
          a.sameNvlinkDomain ? ' on one NVLink domain' : '', a.sameNumaNode ? ' on one NUMA node' : '',
          a.computeNode ? ` on ${a.computeNode.hostname}` : ' (not placed)'))),
        r.gang ? [h('dt', {}, 'Gang'), h('dd', { class: 'gang' }, gangText(r.gang))] : null),
      conditionText(r), h('div', { class: 'actions' }, actions));
  }

  async function act(name, input, done) {
    try {
      await mutate(name, { input });
      toast(`Reservation ${input.id} ${done}.`, 'ok');
    } catch (e) {
      toast(errorText(e), 'error');
    }
  }

  load();
  return {
    onEvent(event) {
      if (event.type.startsWith('reservation.')) ctx.debounce('timeline', load, 250);
      form.onEvent(event);
    },
  };
}

function ticks(from, to) {
  const span = to - from;
  const step = [3600e3, 3 * 3600e3, 6 * 3600e3, 12 * 3600e3, 24 * 3600e3].find((s) => span / s <= 12) || 48 * 3600e3;
  const out = [];
  // The last tick's label would run past the chart's edge.
  for (let t = Math.ceil(from / step) * step; t < to - span * 0.04; t += step) {
    const tick = h('span', { class: 'gantt-tick' }, new Date(t).toLocaleString(undefined, step >= 24 * 3600e3 ? { month: 'short', day: 'numeric' } : { hour: '2-digit', minute: '2-digit' }));
    tick.style.left = `${(100 * (t - from)) / span}%`;
    out.push(tick);
  }
  return out;
}

/// A gang's rule in words, as the server's messages say it.
export function gangText(g) {
  const together = g.colocate === 'NODE' ? 'on one node' : g.colocate === 'LABEL' ? `on nodes of one ${g.label}` : '';
  if (g.spread) return together ? `${together}, each on a node of its own` : 'each on a node of its own';
  return together;
}

/// The reservation's `Unschedulable` (or other false) condition, with its counts.
export function conditionText(r) {
  const bad = (r.conditions || []).filter((c) => c.status !== 'True' && c.message);
  if (!bad.length) return null;
  return bad.map((c) => h('div', { class: 'condition' },
    h('strong', {}, c.reason || c.type), ': ', c.message,
    c.counts && c.counts.length ? h('ul', { class: 'counts' }, c.counts.map((k) => h('li', {}, h('span', { class: 'mono' }, k.reason), ` ${k.count}`))) : null));
}

/// The reserve form. A submission's idempotency key is made when it is first sent and kept until
/// the form is changed: a double click, a retry after a network error, or sending the same form
/// again all replay the one reservation instead of booking twice.
export function reserveForm(ctx, { compact = false } = {}) {
  const pools = ctx.pools();
  const f = {
    pool: h('select', { name: 'pool', id: 'reserve-pool' }, pools.map((p) => h('option', { value: p.id }, `${p.siteName} / ${p.name}`))),
    kind: h('select', { name: 'kind', id: 'reserve-kind' }, ['GPU', 'MIG', 'SLOT'].map((k) => h('option', { value: k }, k))),
    model: h('select', { name: 'model', id: 'reserve-model' }),
    profile: h('select', { name: 'profile', id: 'reserve-profile' }),
    count: h('input', { name: 'count', id: 'reserve-count', type: 'number', min: 1, value: 1 }),
    slots: h('input', { name: 'slots', id: 'reserve-slots', type: 'number', min: 1, value: 1 }),
    vcpu: h('input', { name: 'vcpu', id: 'reserve-vcpu', type: 'number', min: 0, value: 0 }),
    memory: h('input', { name: 'memory', id: 'reserve-memory', type: 'number', min: 0, value: 0 }),
    disk: h('input', { name: 'disk', id: 'reserve-disk', type: 'number', min: 0, value: 0 }),
    start: h('input', { name: 'start', id: 'reserve-start', type: 'datetime-local' }),
    hours: h('input', { name: 'hours', id: 'reserve-hours', type: 'number', min: 0.25, step: 0.25, value: 1 }),
  };
  const submit = h('button', { type: 'submit', id: 'reserve-submit', class: 'primary' }, 'Reserve');
  const result = h('div', { id: 'reserve-result', class: 'result' });
  const row = (label, input, cls) => h('label', { class: cls }, h('span', {}, label), input);
  const profileRow = row('MIG profile', f.profile, 'only-mig');
  const slotsRow = row('Slots per GPU', f.slots, 'only-slot');
  const element = h('form', { id: 'reserve-form', class: compact ? 'form compact' : 'form', novalidate: true },
    row('Pool', f.pool), row('Kind', f.kind), row('Model', f.model), profileRow, slotsRow, row('Count', f.count),
    row('vCPU', f.vcpu), row('Memory (MiB)', f.memory), row('Disk (GiB)', f.disk),
    row('Start (empty: now)', f.start), row('Hours', f.hours),
    h('div', { class: 'actions' }, submit, h('button', { type: 'button', id: 'reserve-new', onclick: () => reset() }, 'New request')), result);

  let key = null;
  let inFlight = null;
  // The answer shown under the form: `{ r, replay }`, or null.
  let shown = null;
  const forget = () => {
    key = null;
  };
  const reset = () => {
    forget();
    shown = null;
    clear(result);
  };
  element.addEventListener('input', forget);
  element.addEventListener('change', forget);

  function options() {
    const pool = pools.find((p) => p.id === f.pool.value);
    const caps = (pool ? pool.capacity : []).filter((c) => c.kind === f.kind.value);
    const models = [...new Set(caps.map((c) => c.model))];
    const keep = f.model.value;
    clear(f.model, models.length ? models.map((m) => h('option', { value: m, selected: m === keep }, m)) : h('option', { value: '' }, 'none in this pool'));
    const profiles = [...new Set(caps.filter((c) => c.model === f.model.value && c.profile).map((c) => c.profile))];
    clear(f.profile, profiles.map((p) => h('option', { value: p }, p)));
    profileRow.hidden = f.kind.value !== 'MIG';
    slotsRow.hidden = f.kind.value !== 'SLOT';
  }
  f.pool.addEventListener('change', options);
  f.kind.addEventListener('change', options);
  f.model.addEventListener('change', options);
  options();

  function input() {
    const start = f.start.value ? new Date(f.start.value) : null;
    const hours = Number(f.hours.value);
    if (!(hours > 0)) throw new Error('Hours must be more than 0.');
    const begins = start || new Date();
    const alloc = {
      gpuKind: f.kind.value,
      gpuCount: Math.trunc(Number(f.count.value)),
      model: f.model.value || null,
      vcpu: Math.trunc(Number(f.vcpu.value) || 0),
      memoryMib: Math.trunc(Number(f.memory.value) || 0),
      diskGib: Math.trunc(Number(f.disk.value) || 0),
    };
    if (f.kind.value === 'MIG') alloc.profile = f.profile.value || null;
    if (f.kind.value === 'SLOT') alloc.slotsPerGpu = Math.trunc(Number(f.slots.value));
    return {
      poolId: f.pool.value,
      startsAt: start ? start.toISOString() : null,
      endsAt: new Date(begins.getTime() + hours * 3600e3).toISOString(),
      allocations: [alloc],
      idempotencyKey: key,
    };
  }

  element.addEventListener('submit', async (e) => {
    e.preventDefault();
    // A second click while the first is on its way waits for the same answer.
    if (inFlight) return inFlight;
    inFlight = (async () => {
      submit.disabled = true;
      key = key || newKey();
      try {
        const payload = (await mutate('ConsoleCreateReservation', { input: input() })).createReservation;
        shown = { r: payload.reservation, replay: payload.idempotentReplay };
        showOutcome();
      } catch (err) {
        shown = null;
        clear(result, h('div', { class: 'outcome error', dataset: { code: err.code || '' } }, errorText(err)));
      } finally {
        submit.disabled = false;
        inFlight = null;
      }
    })();
    return inFlight;
  });

  /// The last answer, kept current by the reservation's events (a cancel from the timeline's
  /// details, its activation, its end), so the form never shows a state that has passed.
  function showOutcome() {
    const { r, replay } = shown;
    clear(result, h('div', { class: `outcome ${r.state.toLowerCase()}`, dataset: { reservation: r.id, replay, state: r.state } },
      h('strong', {}, r.state === 'PENDING' ? 'Pending: ' : 'Reserved: '), h('span', { class: 'mono' }, r.id),
      ` ${r.state}`, replay ? ' (the same request again: nothing new was booked)' : '',
      h('div', { class: 'muted' }, `${fmtTime(r.startsAt)} → ${fmtTime(r.endsAt)}`), conditionText(r)));
  }

  return {
    element,
    onEvent(event) {
      const p = event.payload;
      if (!shown || !p || p.__typename !== 'ReservationEventPayload' || p.reservation.id !== shown.r.id) return;
      // The event's state replaces the answer's; its conditions are the answer's until then.
      shown = { ...shown, r: { ...shown.r, ...p.reservation, conditions: p.reservation.state === 'PENDING' ? shown.r.conditions : [] } };
      showOutcome();
    },
    setPool(id) {
      if (id && f.pool.value !== id) {
        f.pool.value = id;
        options();
        forget();
      }
    },
    prefill({ poolId, kind, model, start, hours }) {
      f.pool.value = poolId;
      f.kind.value = kind;
      options();
      f.model.value = model;
      options();
      f.start.value = start && start > new Date() ? toLocalInput(start) : '';
      f.hours.value = hours;
      reset();
    },
  };
}
