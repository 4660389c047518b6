// Search on a page opened from disk (file://), with nothing fetched from the network.
//
// Material runs its search in a Web Worker, and browsers refuse to start a worker from a file://
// page. Material's offline plugin then loads a stand-in from a CDN (unpkg's iframe-worker); it
// does not when mkdocs.yml lists a polyfill with "iframe-worker" in its name, this file. It
// defines a Worker that runs the worker's script in a hidden same-origin frame: the page's
// postMessage becomes a "message" event in the frame, the script's postMessage one on the page.
// Served over http(s), the browser's own Worker is left alone.
(function () {
  "use strict";
  if (location.protocol !== "file:") {
    return;
  }

  function copy(data) {
    return typeof structuredClone === "function" ? structuredClone(data) : data;
  }

  class FrameWorker extends EventTarget {
    constructor(url) {
      super();
      this.onmessage = null;
      this.onerror = null;
      this.pending = [];
      this.ready = false;
      this.frame = document.createElement("iframe");
      this.frame.hidden = true;
      (document.body || document.documentElement).appendChild(this.frame);
      const scope = this.frame.contentWindow;
      // the worker's side of the channel
      scope.postMessage = (data) => setTimeout(() => this.emit("message", {data: copy(data)}));
      scope.importScripts = () => {
        throw new Error("importScripts is not available to a worker of a page opened from disk");
      };
      const script = scope.document.createElement("script");
      script.src = new URL(url, location.href).href;
      script.onload = () => {
        this.ready = true;
        this.pending.splice(0).forEach((data) => this.deliver(data));
      };
      script.onerror = () => this.emit("error", {message: `cannot load the worker script ${url}`});
      scope.document.head.appendChild(script);
    }

    emit(type, init) {
      const event = type === "message" ? new MessageEvent(type, init) : new ErrorEvent(type, init);
      const handler = type === "message" ? this.onmessage : this.onerror;
      if (handler) {
        handler.call(this, event);
      }
      this.dispatchEvent(event);
    }

    deliver(data) {
      const scope = this.frame.contentWindow;
      setTimeout(() => scope.dispatchEvent(new scope.MessageEvent("message", {data: copy(data)})));
    }

    postMessage(data) {
      if (this.ready) {
        this.deliver(data);
      } else {
        this.pending.push(data);
      }
    }

    terminate() {
      this.frame.remove();
    }
  }

  window.Worker = FrameWorker;
})();
