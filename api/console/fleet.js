// The fleet: sites → pools → nodes, capacity bars per GPU model and kind (now, or over a chosen
// window), node liveness, cordons and taints, and the reservations per state. Redrawn when
// node, device or reservation events arrive.

import { gql } from './api.js';
import { h, clear, bar, sizeBars, capacityLabel, virtualList, barChart, errorText, toLocalInput, fmtTime } from './ui.js';

const NODE_PAGE = 100;

export function fleetView(root, ctx) {
  const state = { window: null, open: new Set(ctx.prefs.openPools || []), lists: new Map() };
  const from = h('input', { type: 'datetime-local', id: 'fleet-from' });
  const to = h('input', { type: 'datetime-local', id: 'fleet-to' });
  const mode = h('select', { id: 'fleet-window' }, h('option', { value: 'now' }, 'Now'), h('option', { value: 'window' }, 'Over a window'));
  const now = new Date();
  from.value = toLocalInput(now);
  to.value = toLocalInput(new Date(now.getTime() + 4 * 3600e3));
  const windowBox = h('span', { class: 'window', hidden: true }, ' from ', from, ' to ', to);
  const body = h('div', { id: 'fleet-body' }, h('p', { class: 'muted' }, 'Loading the fleet…'));
  const counts = h('div', { class: 'panel', id: 'state-counts' });
  clear(root,
    h('div', { class: 'toolbar' }, h('h1', {}, 'Fleet'), h('label', {}, 'Capacity ', mode), windowBox),
    h('div', { class: 'columns' }, body, h('aside', {}, h('h2', {}, 'Reservations by state'), counts)));

  const readWindow = () => {
    if (mode.value !== 'window') return null;
    const start = new Date(from.value);
    const end = new Date(to.value);
    if (!(start < end)) return undefined;
    return { start: start.toISOString(), end: end.toISOString() };
  };
  const onChange = () => {
    windowBox.hidden = mode.value !== 'window';
    const w = readWindow();
    if (w === undefined) return;
    state.window = w;
    load();
  };
  mode.addEventListener('change', onChange);
  from.addEventListener('change', onChange);
  to.addEventListener('change', onChange);

  let loading = null;
  async function load() {
    if (loading) return loading;
    loading = (async () => {
      try {
        const [fleet, byState] = await Promise.all([
          gql('ConsoleFleet', { window: state.window }),
          gql('ConsoleReservationCounts', { window: state.window }),
        ]);
        drawFleet(fleet);
        clear(counts, stateChart(byState));
      } catch (e) {
        clear(body, h('p', { class: 'error' }, errorText(e)));
      } finally {
        loading = null;
      }
    })();
    return loading;
  }

  function drawFleet(data) {
    state.lists.clear();
    const sites = data.sites.nodes;
    if (!sites.length) {
      clear(body, h('p', { class: 'muted' }, 'No sites yet. An operator creates them with createSite.'));
      return;
    }
    clear(body, sites.map((site) => h('section', { class: 'site', dataset: { site: site.id } },
      h('h2', {}, site.name, site.region ? h('span', { class: 'muted' }, ` · ${site.region}`) : null),
      h('div', { class: 'caps' }, site.capacity.map((c) => bar(capacityLabel(c), c.booked, c.total))),
      site.pools.nodes.map((pool) => poolCard(pool)))));
    sizeBars(body);
  }

  function poolCard(pool) {
    const nodes = h('div', { class: 'nodes' });
    // Nodes are for operators (the API says FORBIDDEN to members); members see capacity.
    const toggle = ctx.isOperator()
      ? h('button', { type: 'button', class: 'link', dataset: { pool: pool.id } }, state.open.has(pool.id) ? 'Hide nodes' : 'Show nodes')
      : h('span', { class: 'muted' }, '');
    const card = h('div', { class: 'pool', dataset: { pool: pool.id } },
      h('h3', {}, pool.name, h('span', { class: 'tag' }, pool.kind), toggle),
      h('div', { class: 'caps' }, pool.capacity.length ? pool.capacity.map((c) => bar(capacityLabel(c), c.booked, c.total)) : h('span', { class: 'muted' }, 'no devices')),
      nodes);
    if (!ctx.isOperator()) return card;
    toggle.addEventListener('click', () => {
      if (state.open.has(pool.id)) {
        state.open.delete(pool.id);
        state.lists.delete(pool.id);
        clear(nodes);
        toggle.textContent = 'Show nodes';
      } else {
        state.open.add(pool.id);
        toggle.textContent = 'Hide nodes';
        loadNodes(pool, nodes);
      }
      ctx.prefs.openPools = [...state.open];
    });
    if (state.open.has(pool.id)) loadNodes(pool, nodes);
    return card;
  }

  async function loadNodes(pool, box) {
    clear(box, h('p', { class: 'muted' }, 'Loading nodes…'));
    try {
      const all = [];
      let after = null;
      let total = 0;
      // Page through the connection; a thousand-node pool is five pages.
      for (;;) {
        const page = await gql('ConsolePoolNodes', { poolId: pool.id, first: NODE_PAGE, after });
        const c = page.computeNodes;
        total = c.totalCount;
        all.push(...c.nodes);
        if (!c.pageInfo.hasNextPage || all.length >= 5000) break;
        after = c.pageInfo.endCursor;
      }
      const list = virtualList(all, 34, nodeRow, 420);
      clear(box,
        summaryOf(all, total),
        h('div', { class: 'node-head' }, h('span', {}, 'Node'), h('span', {}, 'Liveness'), h('span', {}, 'GPUs'), h('span', {}, 'vCPU'), h('span', {}, 'Memory'), h('span', {}, 'Scheduling')),
        list);
      state.lists.set(pool.id, { byId: new Map(all.map((n) => [n.id, n])), list, summary: box.querySelector('.node-summary'), all, total });
    } catch (e) {
      clear(box, h('p', { class: 'error' }, errorText(e)));
    }
  }

  // A node's event updates its row in place from the event's typed payload: no page of nodes
  // is read again, however often nodes connect and disconnect.
  function patchNode(node) {
    for (const open of state.lists.values()) {
      const n = open.byId.get(node.id);
      if (!n) continue;
      n.reachability = node.reachability;
      n.cordoned = node.cordoned;
      n.cordonReason = node.cordonReason;
      open.list.refresh();
      const summary = summaryOf(open.all, open.total);
      open.summary.replaceWith(summary);
      open.summary = summary;
    }
  }

  load();
  return {
    refresh: load,
    onEvent(event) {
      const p = event.payload;
      if (p && p.__typename === 'NodeEventPayload' && event.type !== 'node.registered' && event.type !== 'node.retired') {
        patchNode(p.node);
        return;
      }
      // Capacity moved (a reservation, a device, a pool): the sites and pools, not the nodes.
      if (/^(device|reservation|pool|site)\./.test(event.type)) ctx.debounce('fleet-capacity', refreshCapacity, 1000);
      if (/^node\.(registered|retired)$/.test(event.type)) ctx.debounce('fleet', load, 1000);
    },
  };

  async function refreshCapacity() {
    try {
      const [fleet, byState] = await Promise.all([
        gql('ConsoleFleet', { window: state.window }),
        gql('ConsoleReservationCounts', { window: state.window }),
      ]);
      for (const site of fleet.sites.nodes) {
        const card = body.querySelector(`.site[data-site="${site.id}"] > .caps`);
        if (card) clear(card, site.capacity.map((c) => bar(capacityLabel(c), c.booked, c.total)));
        for (const pool of site.pools.nodes) {
          const caps = body.querySelector(`.pool[data-pool="${pool.id}"] > .caps`);
          if (caps) clear(caps, pool.capacity.map((c) => bar(capacityLabel(c), c.booked, c.total)));
        }
      }
      sizeBars(body);
      clear(counts, stateChart(byState));
    } catch (e) {
      // The next event tries again; the page keeps what it shows.
    }
  }
}

function stateChart(byState) {
  return barChart(['pending', 'scheduled', 'active', 'released', 'cancelled', 'expired'].map((k) => ({
    label: k, value: byState[k].totalCount, cls: k,
  })));
}

function summaryOf(all, total) {
  const counts = {};
  for (const n of all) counts[n.reachability] = (counts[n.reachability] || 0) + 1;
  return h('div', { class: 'node-summary' }, `${total} nodes: `,
    Object.entries(counts).map(([k, v]) => h('span', { class: `badge ${k.toLowerCase()}` }, `${v} ${k}`)),
    ` · ${all.filter((n) => n.cordoned).length} cordoned`);
}

function resource(n, kind) {
  return n.resources.find((r) => r.resource === kind);
}

function nodeRow(n) {
  const models = {};
  for (const d of n.devices) models[d.model] = (models[d.model] || 0) + 1;
  const sick = n.devices.filter((d) => d.quarantined || d.health !== 'HEALTHY').length;
  const vcpu = resource(n, 'VCPU');
  const mem = resource(n, 'MEMORY_MIB');
  const meter = (r) => {
    if (!r) return h('span', { class: 'muted' }, '—');
    const pct = r.allocatable > 0 ? Math.round((100 * r.allocated) / r.allocatable) : 0;
    const m = h('span', { class: 'mini', title: `${r.allocated} of ${r.allocatable} allocated` }, h('span', { class: 'mini-fill' }));
    m.firstChild.style.width = `${pct}%`;
    return m;
  };
  return h('div', { class: 'node-row', dataset: { node: n.id, hostname: n.hostname } },
    h('span', { class: 'mono' }, n.hostname),
    h('span', {}, h('span', { class: `badge ${n.reachability.toLowerCase()}`, title: `since ${fmtTime(n.reachabilitySince)}` }, n.reachability)),
    h('span', {}, Object.entries(models).map(([m, c]) => `${c}× ${m}`).join(', ') || '—', sick ? h('span', { class: 'badge lost' }, `${sick} unhealthy`) : null),
    meter(vcpu),
    meter(mem),
    h('span', {},
      n.cordoned ? h('span', { class: 'badge cordoned', title: n.cordonReason || '' }, 'cordoned') : null,
      n.lifecycle === 'RETIRED' ? h('span', { class: 'badge' }, 'retired') : null,
      n.taints.map((t) => h('span', { class: 'chip', title: t.effect }, `${t.key}=${t.value}:${t.effect}`))));
}
